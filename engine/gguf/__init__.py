"""The GGUF format layer: reading a file's header and tensors (:mod:`.file`, :mod:`.header`), the quant types'
block sizes and reference dequantization (:mod:`.quant`), writing a file (:mod:`.write`), and reading a file
the engine did not write (:mod:`.regular`). It knows no model family beyond the tensor tables it is given.
"""
