"""Per-shard programs: ``shard_map``, the named collectives, pytree specs, ``tree_shard``/``tree_gather``, and
DTensor conversions."""
