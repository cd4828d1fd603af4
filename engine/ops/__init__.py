"""Plain numpy reference ops, the executable spec the fast kernels are tested against: the text model
(:mod:`.reference`) and the vision tower (:mod:`.vision_reference`)."""
