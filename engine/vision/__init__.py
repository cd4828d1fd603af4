"""Images in: reading and resizing an image (:mod:`.images`) and the vision tower that turns it into
embeddings for the text model (:mod:`.encoder`).
"""
