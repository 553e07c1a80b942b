"""Image embeddings kept in a registered memory region and moved by the transfer engine.

    rows.RowRegion      a registered region of embedding rows with a contiguous-range allocator
    store.EmbedsStore   encode side: rows waiting to be pulled, freed once pulled or after a timeout
    ref.EmbedsRef       the metadata an encode worker answers with (shape, dtype, aux, digest, where)
    fetch.EmbedsFetcher prefill side: pulls the rows of an EmbedsRef into its own region
    parts.PartResolver  a worker's image parts of both kinds (image_url loaded, image_embeds pulled)
    app, serve, flags   the encode worker's HTTP server (`python -m worker --role encode`) and its flags
"""
