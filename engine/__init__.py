"""DeltaDesk's inference engine: load a GGUF model once, then chat with it turn by turn (see :mod:`engine.api`)."""
