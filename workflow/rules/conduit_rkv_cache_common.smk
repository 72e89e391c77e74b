# Helpers of the compressed-image-cache target (conduit_rkv_cache.smk; the plan is common.smk's CRC). Functions only:
# Snakemake's lint wants rules and functions in separate files.


def crc_cache_dir(dataset):
    """Compressed-cache root of one dataset (the conduit_rkv_cache rule's index.json lives there)."""
    return CRC.cache_dir(dataset, CRC.codec_dir)


def _crc_dataset(wc):
    """The dataset of a compressed-cache directory (its path names it; checked against the plan's)."""
    if CRC is None or wc.task not in CRC.datasets or crc_cache_dir(wc.task) != f"cache/conduit_rkv/{wc.profile}/{wc.model}/{wc.task}/{wc.tag}":
        raise ValueError(f"cache/conduit_rkv/{wc.profile}/{wc.model}/{wc.task}/{wc.tag} is not this config's "
                         "compressed image cache (beyond.conduit_rkv_cache: its model, Table 1's datasets, the codec "
                         "and storage hash)")
    return wc.task
