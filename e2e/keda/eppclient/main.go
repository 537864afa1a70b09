// Built by e2e/keda/tools.py into the epp tool: one request to an endpoint picker over Envoy's ext_proc protocol, as Envoy sends it.
//
// Usage: eppclient ADDRESS MODEL. It opens ExternalProcessor/Process on ADDRESS (plaintext), sends the request
// headers of a POST /v1/completions and then its JSON body naming MODEL, prints "sent" once both are written, and then
// one line per response the picker sends: "headers <destination>" when it picked an endpoint, "immediate <status>"
// when it answered the request itself. It exits when the picker closes the stream, or when stdin closes (the test
// gives up on the request: the stream's context is cancelled, as Envoy cancels it when its client leaves).
package main

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

func main() {
	if len(os.Args) != 3 {
		fmt.Fprintln(os.Stderr, "usage: eppclient ADDRESS MODEL")
		os.Exit(2)
	}
	address, model := os.Args[1], os.Args[2]
	conn, err := grpc.NewClient(address, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		fmt.Fprintln(os.Stderr, "dial:", err)
		os.Exit(1)
	}
	defer conn.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		// Stdin closing is the test leaving: cancel the stream as Envoy does when its downstream goes away.
		_, _ = io.Copy(io.Discard, bufio.NewReader(os.Stdin))
		cancel()
	}()
	// WaitForReady: the picker may still be starting its gRPC server when the test sends.
	stream, err := extprocv3.NewExternalProcessorClient(conn).Process(ctx, grpc.WaitForReady(true))
	if err != nil {
		fmt.Fprintln(os.Stderr, "open stream:", err)
		os.Exit(1)
	}
	body := fmt.Sprintf(`{"model":%q,"prompt":"hello","max_tokens":1}`, model)
	headers := []*corev3.HeaderValue{
		{Key: ":method", RawValue: []byte("POST")},
		{Key: ":path", RawValue: []byte("/v1/completions")},
		{Key: ":authority", RawValue: []byte("gateway")},
		{Key: "content-type", RawValue: []byte("application/json")},
		{Key: "content-length", RawValue: []byte(fmt.Sprint(len(body)))},
	}
	requests := []*extprocv3.ProcessingRequest{
		{Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{
			Headers: &corev3.HeaderMap{Headers: headers},
		}}},
		{Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{
			Body: []byte(body), EndOfStream: true,
		}}},
	}
	for _, request := range requests {
		if err := stream.Send(request); err != nil {
			fmt.Fprintln(os.Stderr, "send:", err)
			os.Exit(1)
		}
	}
	fmt.Println("sent")
	for {
		response, err := stream.Recv()
		if err != nil {
			fmt.Fprintln(os.Stderr, "stream ended:", err)
			return
		}
		switch r := response.Response.(type) {
		case *extprocv3.ProcessingResponse_RequestHeaders:
			destination := ""
			for _, option := range r.RequestHeaders.GetResponse().GetHeaderMutation().GetSetHeaders() {
				if option.GetHeader().GetKey() == "x-gateway-destination-endpoint" {
					destination = string(option.GetHeader().GetRawValue()) + option.GetHeader().GetValue()
				}
			}
			fmt.Println("headers", destination)
		case *extprocv3.ProcessingResponse_ImmediateResponse:
			fmt.Println("immediate", r.ImmediateResponse.GetStatus().GetCode())
		default:
			fmt.Printf("other %T\n", r)
		}
	}
}
