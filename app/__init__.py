"""moechat.app: the user's side: the command line, the Textual chat app, the server, the benchmarks."""
