"""End-to-end tests: the real ``gpuscaler serve`` process, driven over real sockets by grpclib and grpcio."""
