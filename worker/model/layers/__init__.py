"""Building blocks of the decoder: rotary embeddings, paged attention (with a native decode path), packable linears."""
