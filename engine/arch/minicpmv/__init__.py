"""MiniCPM-V 4.6 vision (``clip.projector_type = "minicpmv4_6"``): a SigLIP2 tower with a window-attention
merger, on the dense Qwen3.5 text model (GGUF ``qwen35``).

- :mod:`.mmproj`: the llama.cpp projector layout (keys, tensors), validated reading, random-weight writing;
- :mod:`.preprocess`: HF ``MiniCPMV4_6ImageProcessorPil`` (resize, slicing, patches, position buckets,
  image-token counts);
- :mod:`.tower`: the numpy float32 forward (16x and 4x modes);
- :mod:`.encoder`: the prompt layout of an image and an image encoder with an embedding cache.

The facts are taken from HF transformers ``models/minicpmv4_6/`` (``modeling_minicpmv4_6.py``,
``image_processing_pil_minicpmv4_6.py``, ``processing_minicpmv4_6.py``, ``configuration_minicpmv4_6.py``,
``vision_utils.py``) and llama.cpp PR #22529 (``tools/mtmd/models/minicpmv.cpp``
``clip_graph_minicpmv4_6``, ``conversion/minicpm.py`` ``MiniCPMV4_6VisionModel``); ``docs/minicpmv.md``
summarises them.
"""
