"""What the app does not need: the CPU benchmark and its llama-bench peer (:mod:`.cpu_bench`, :mod:`.cpu_llama`)
and synthetic text + vision pairs (:mod:`.synth`)."""
