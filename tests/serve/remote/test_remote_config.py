"""store.yaml's ``remote`` section: the shipped example loads, bad input names the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from tiercache import PolicyError
from tiercache.serve.config import load_store_config

EXAMPLE = Path(__file__).resolve().parents[3] / "configs" / "serve" / "store-remote.yaml"
URL = "redis://127.0.0.1:6379/0"


def test_the_example_loads():
    cfg = load_store_config(EXAMPLE)
    assert cfg.remote.url == URL and cfg.remote.chunk_tokens == 256 and cfg.remote.ttl == 86400
    assert cfg.remote.timeout == 0.5 and cfg.remote.quantize is None and cfg.remote.write == "turn"
    assert cfg.remote_rung and len(cfg.ladder) == 1  # `remote` is a rung, not a policy


def test_defaults_and_forms():
    cfg = load_store_config({"remote": {"url": URL}})
    assert (cfg.remote.chunk_tokens, cfg.remote.ttl, cfg.remote.timeout) == (256, 86400, 0.5)
    assert not cfg.remote_rung and load_store_config({}).remote is None
    cfg = load_store_config({"remote": {"url": URL, "ttl": "12h", "timeout": 2, "chunk_tokens": 128,
                                        "quantize": {"bits": 4, "group_size": 64}}, "ladder": ["remote"]})
    assert cfg.remote.ttl == 43200 and cfg.remote.timeout == 2 and cfg.remote.quantize.bits == 4
    assert cfg.remote.quantize.residual_length == 0 and cfg.ladder == () and cfg.remote_rung
    assert load_store_config({"remote": {"url": URL, "ttl": None}}).remote.ttl is None


@pytest.mark.parametrize("data, words", [
    ({"remote": "redis://x"}, "store.remote: expected a mapping"),
    ({"remote": {}}, "store.remote.url: missing"),
    ({"remote": {"url": "http://x:6379"}}, "store.remote.url: expected a URL with scheme"),
    ({"remote": {"url": URL, "chunk_tokens": 0}}, "store.remote.chunk_tokens"),
    ({"remote": {"url": URL, "ttl": "forever"}}, "store.remote.ttl: expected a duration"),
    ({"remote": {"url": URL, "ttl": "100ms"}}, "store.remote.ttl: at least 1s"),
    ({"remote": {"url": URL, "timeout": 0}}, "store.remote.timeout: must be > 0"),
    ({"remote": {"url": URL, "write": "always"}}, "store.remote.write: 'always' is not allowed; allowed: 'turn' | 'demote'"),
    ({"remote": {"url": URL, "write": "demote"}}, "add 'remote' as the last rung"),
    ({"remote": {"url": URL, "quantize": {"bits": 4, "group_size": 96}}}, "must divide store.remote.chunk_tokens"),
    ({"remote": {"url": URL, "quantize": {"backend": "quanto"}}}, "store.remote.quantize.backend"),
    ({"remote": {"url": URL, "quantize": {"bits": 5}}}, "store.remote.quantize"),
    ({"remote": {"url": URL, "quantize": {"residual_length": 64}}}, "do not apply to chunks"),
    ({"remote": {"url": URL, "port": 1}}, "store.remote.port: unknown field; allowed: url, chunk_tokens"),
    ({"ladder": ["remote"]}, "store.ladder[0]: the 'remote' rung needs a store.remote section"),
    ({"ladder": ["remote", {"name": "h", "offload": {"device": "cpu"}}], "remote": {"url": URL}},
     "store.ladder[0]: 'remote' can only be the last rung"),
])
def test_bad_remote_sections_name_the_field(data, words):
    with pytest.raises(PolicyError) as e:
        load_store_config(data)
    assert words in str(e.value)
