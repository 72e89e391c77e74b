"""Writers of tables beyond both papers: CONDUIT over ResidualKV-compressed image caches (:mod:`.conduit_rkv_cache`)."""
