"""Media in: decoding streamed containers and turning frames and audio into model input."""
