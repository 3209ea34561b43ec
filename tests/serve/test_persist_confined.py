"""``--persist DIR`` reads only files of DIR: a manifest cannot name a file elsewhere (absolute,
``..``, a sub-path, a symlink out), and a saved disk tier's path is the server's, never the file's."""

from __future__ import annotations

import json
import logging
import os

import pytest

from serve.test_store_persist import FULL, filled, held, ids_of, loaded, store_of
from tiercache.models.load import load_model
from tiercache.policy.schema import load_policy
from tiercache.serve.persist import MANIFEST, load_entries, save_entries
from tiercache.serve.store import PrefixStore


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-random")[0]


def test_manifest_names_that_leave_the_directory_are_refused(tiny, tmp_path, caplog):
    home, outside = tmp_path / "persist", tmp_path / "elsewhere"
    good, far = ids_of(1, 20), ids_of(2, 20)
    save_entries(store_of(tiny, [far]), outside)  # a valid entry, outside the directory
    far_name = json.loads((outside / MANIFEST).read_text())["entries"][0]["file"]
    save_entries(store_of(tiny, [good]), home)
    manifest = json.loads((home / MANIFEST).read_text())
    (home / "sub").mkdir()
    os.symlink(outside / far_name, home / "link.tiercache")
    os.symlink(outside / far_name, home / "sub" / "inner.tiercache")
    evil = [str(outside / far_name), f"../elsewhere/{far_name}", "sub/inner.tiercache", "link.tiercache", "..", ""]
    manifest["entries"] += [{"file": name, "tokens": 20} for name in evil] + [{"file": 7, "tokens": 1}]
    (home / MANIFEST).write_text(json.dumps(manifest))
    with caplog.at_level(logging.ERROR, logger="tiercache.serve"):
        back = loaded(tiny, home)
    assert held(back) == {tuple(good)}  # the entry of the directory, and only it
    assert back.refused == []  # refused names are not named again by the next save
    assert sum("not a file of that directory" in r.getMessage() for r in caplog.records) == len(evil) + 1
    save_entries(back, home, keep=[str(outside / far_name), "link.tiercache"])
    names = [r["file"] for r in json.loads((home / MANIFEST).read_text())["entries"]]
    assert len(names) == 1 and "/" not in names[0]
    assert (outside / far_name).is_file()  # nothing outside was touched
    assert held(loaded(tiny, outside)) == {tuple(far)}


def test_a_disk_rung_loads_under_the_servers_disk_path(tiny, tmp_path):
    def disk(spot):
        return load_policy({"name": "disk", "offload": {"device": "disk", "path": str(spot)}})

    def ladder_store(spot):
        return PrefixStore([FULL, disk(spot)], {}, lambda c: c.tier_nbytes(), block_size=8, min_match=4)

    theirs, ours = tmp_path / "their-disk", tmp_path / "our-disk"
    ids = ids_of(3, 20)
    store = ladder_store(theirs)
    store.put(ids, filled(tiny, ids, disk(theirs)), 1)
    save_entries(store, tmp_path / "p")  # (closes the store: its disk files are gone)
    assert not any(theirs.iterdir())
    back = ladder_store(ours)  # a server configured with another disk path
    assert load_entries(back, tmp_path / "p", tiny.config, 256).count == 1
    ((cache_ids, cache, rung),) = back.entries()
    assert rung == 1 and list(cache_ids) == ids and cache.policy == disk(ours)
    assert set(cache.tier_nbytes()) == {"disk"} and any(ours.iterdir())  # under this server's path
    assert not any(theirs.iterdir())  # the path written in the file: not used
    back.close()
