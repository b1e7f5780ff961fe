"""Python client SDK and command-line tools for a streamer service."""
