"""One package per model family (a GGUF ``general.architecture`` or an mmproj ``clip.projector_type``), each
defining ``ARCH`` for :mod:`engine.registry`; see docs/adding-an-architecture.md."""
