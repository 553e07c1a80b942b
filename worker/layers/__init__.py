"""Building blocks of the decoder: rotary embeddings, paged attention, packable linears."""
