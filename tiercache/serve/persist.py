"""Persistence placeholder (filled in once TieredCache.save/load land)."""


def load_entries(store, directory, model_config) -> int:
    raise NotImplementedError("--persist needs TieredCache.save/load")


def save_entries(store, directory) -> int:
    raise NotImplementedError("--persist needs TieredCache.save/load")
