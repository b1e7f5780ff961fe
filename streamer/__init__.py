"""streamer: stateful sessions that reason over live inputs."""

__version__ = "0.1.0"
