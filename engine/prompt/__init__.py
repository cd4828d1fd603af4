"""From a conversation to token ids: the chat template (:mod:`.template`, the bundled ``templates/``), the
tokenizer built from GGUF metadata (:mod:`.tokenizer`) and the prompt builder that places image tokens and
checks the context (:mod:`.builder`).
"""
