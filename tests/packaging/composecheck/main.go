// composecheck loads a compose file with compose-go, the loader Docker Compose itself uses, and prints the
// resulting project as JSON. The packaging tests run it on compose.yaml, so the file stays one that
// `docker compose up` accepts, beyond what the Compose specification's schema checks.
package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"

	"github.com/compose-spec/compose-go/v2/cli"
)

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: composecheck COMPOSE_FILE")
		os.Exit(2)
	}
	path, err := filepath.Abs(os.Args[1])
	if err != nil {
		fail(err)
	}
	options, err := cli.NewProjectOptions(
		[]string{path},
		cli.WithWorkingDirectory(filepath.Dir(path)),
		cli.WithOsEnv,
		cli.WithConsistency(true),
	)
	if err != nil {
		fail(err)
	}
	project, err := options.LoadProject(context.Background())
	if err != nil {
		fail(err)
	}
	out, err := project.MarshalJSON()
	if err != nil {
		fail(err)
	}
	fmt.Println(string(out))
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "composecheck:", err)
	os.Exit(1)
}
