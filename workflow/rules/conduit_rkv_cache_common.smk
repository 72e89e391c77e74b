# Helpers of the compressed-image-cache target (conduit_rkv_cache.smk; the plan is common.smk's CRC). Functions only:
# Snakemake's lint wants rules and functions in separate files.


def crc_codec_dir():
    """The codec the compressed caches are coded with: rule rkv_mm_codec's for the plan's backbone."""
    return f"{mm_codec_dir(CRC.model)}/codec"


def crc_cache_dir(dataset):
    """Compressed-cache root of one dataset (the conduit_rkv_cache rule's index.json lives there)."""
    return CRC.cache_dir(dataset, crc_codec_dir())


def crc_table_inputs():
    """What the table reads: the compressed runs, Table 1's raw runs of the block, the compressed caches' indexes
    (bytes) and the splits (K buckets)."""
    if CRC is None:
        raise ValueError("this config has no `beyond.conduit_rkv_cache:` mapping, so it has no compressed-image-cache "
                         "table (config/config.yaml shows one)")
    runs = [f"{r.path(PROFILE)}/predictions.jsonl" for r in CRC.new_runs() + CRC.raw_runs()]
    return runs + [f"{crc_cache_dir(d)}/index.json" for d in CRC.datasets] + [split_file(d) for d in CRC.datasets]


def crc_report_spec():
    """The JSON kvbench.report.conduit_rkv's writer reads."""
    return json.dumps({"profile": PROFILE, "conduit": config["conduit"], "beyond": config["beyond"],
                       "splits": {d: split_file(d) for d in CRC.datasets}, "zoo_models": ZOO_MODELS,
                       "codec_dir": crc_codec_dir(),
                       "indexes": {d: f"{crc_cache_dir(d)}/index.json" for d in CRC.datasets}}, sort_keys=True)


def _crc_dataset(wc):
    """The dataset of a compressed-cache directory (its path names it; checked against the plan's)."""
    if CRC is None or wc.task not in CRC.datasets or crc_cache_dir(wc.task) != f"cache/conduit_rkv/{wc.profile}/{wc.model}/{wc.task}/{wc.tag}":
        raise ValueError(f"cache/conduit_rkv/{wc.profile}/{wc.model}/{wc.task}/{wc.tag} is not this config's "
                         "compressed image cache (beyond.conduit_rkv_cache: its model, Table 1's datasets, the codec "
                         "and storage hash)")
    return wc.task
