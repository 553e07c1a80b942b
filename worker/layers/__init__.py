"""Building blocks of the decoder: rotary embeddings and paged attention."""
