"""Our own client: channels for the CLI and tests, and what ``gpuscaler query`` prints."""
