"""The session engine: sessions, caches, the model runner and the engine thread."""
