"""A budget can be the card: ``plan(..., gpu_memory=)``, ``budget.gpu_memory`` and ``tiercache plan
--gpu-memory`` judge the whole run's device footprint against a GPU's memory, whatever the cache
budget says; ``fits_card`` is the same check for a search over policies."""

import argparse

import pytest

import tiercache
from tiercache.cli import main
from tiercache.errors import PolicyError
from tiercache.models.spec import ModelSpec
from tiercache.planner.api import fits_card, plan
from tiercache.planner.units import card_size, card_text

GB = 10**9
# int4 KIVI, every layer on the GPU, a cache budget of 6 GiB: the cache alone fits it at 128k
RESIDENT_INT4 = {"name": "resident-int4", "quantize": {"bits": 4}, "budget": {"device": "6GiB"}}


def test_over_the_card_does_not_fit_even_when_the_cache_budget_fits():
    p = plan(RESIDENT_INT4, "Llama-3-8B", 1, 131072, gpu_memory=24 * GB)
    assert all(ok for _, _, ok in p.verdicts().values())  # the cache budget alone: fits
    card = p.card_verdict()
    assert card.used == p.whole.total["device"] > 24 * GB and not card.fits
    assert not p.fits
    table = p.table()
    assert "budget device: " in table and ": fits" in table.split("card:")[0]
    assert "card: whole footprint device" in table and "DOES NOT FIT" in table
    assert table.rstrip().endswith("verdict: does not fit")
    # the same plan on a card that holds it fits, with what it leaves spare
    big = plan(RESIDENT_INT4, "Llama-3-8B", 1, 131072, gpu_memory=40 * GB)
    assert big.fits and big.card_verdict().fits and "to spare" in big.table()
    assert big.table().rstrip().endswith("verdict: fits")


def test_a_card_picks_the_largest_prefill_chunk_that_fits():
    free = plan(RESIDENT_INT4, "Llama-3-8B", 1, 131072)  # no card: the default chunk
    assert free.prefill_chunk == 2048 and free.card_verdict() is None and free.fits
    tight = plan({**RESIDENT_INT4, "quantize": {"bits": 4, "value_bits": 2}}, "Llama-3-8B", 1, 131072)
    used_2048 = tight.whole.total["device"]
    card = used_2048 - 2**20  # one MiB short at 2048 tokens a chunk
    p = plan({**RESIDENT_INT4, "quantize": {"bits": 4, "value_bits": 2}}, "Llama-3-8B", 1, 131072, gpu_memory=card)
    assert p.fits and p.prefill_chunk < 2048 and p.whole.total["device"] <= card
    roomy = plan(RESIDENT_INT4, "Llama-3-8B", 1, 131072, gpu_memory=80 * GB)
    assert roomy.prefill_chunk == 8192 and roomy.fits  # the largest of CHUNKS


def test_the_policy_states_its_card_and_the_caller_overrides_it():
    stated = {**RESIDENT_INT4, "budget": {"device": "6GiB", "gpu_memory": "24GB"}}
    assert tiercache.load_policy(stated).budget.gpu_memory == 24 * GB
    p = plan(stated, "Llama-3-8B", 1, 131072)
    assert p.card == 24 * GB and not p.fits and not p.card_verdict().fits
    assert plan(stated, "Llama-3-8B", 1, 131072, gpu_memory=40 * GB).fits  # the caller's card wins


def test_gb_is_decimal_and_gib_binary():
    assert card_size("24GB") == 24 * 10**9 and card_size("24 gb") == 24 * 10**9
    assert card_size("24GiB") == 24 * 2**30 and card_size("22.35GiB") == int(22.35 * 2**30)
    assert card_text(24 * GB) == "24 GB (22.35 GiB)" and card_text(24 * 2**30) == "24.00 GiB"
    # a footprint between 24e9 bytes and 24 GiB: it fits a "24GiB" card, not a "24GB" one
    policy = {"name": "k4v2", "quantize": {"bits": 4, "value_bits": 2}}
    used = plan(policy, "Llama-3-8B", 1, 131072, prefill_chunk=2048).whole.total["device"]
    assert 24 * GB < used <= 24 * 2**30
    assert not plan(policy, "Llama-3-8B", 1, 131072, prefill_chunk=2048, gpu_memory=card_size("24GB")).fits
    assert plan(policy, "Llama-3-8B", 1, 131072, prefill_chunk=2048, gpu_memory=card_size("24GiB")).fits


def test_a_cpu_plan_leaves_a_policys_card_out_and_refuses_a_callers():
    stated = {"name": "carded", "quantize": {"bits": 4}, "budget": {"gpu_memory": "1GB"}}
    p = plan(stated, "tiny", 1, 1024, device="cpu")
    assert p.card_verdict() is None and p.fits
    assert "card: not checked" in p.table()
    with pytest.raises(PolicyError, match="gpu_memory is a GPU's memory; the plan is for device 'cpu'"):
        plan(stated, "tiny", 1, 1024, device="cpu", gpu_memory=8 * GB)
    with pytest.raises(PolicyError, match="gpu_memory is the card's memory in bytes"):
        plan(stated, "tiny", 1, 1024, gpu_memory=-1)


def test_a_card_without_its_unit_is_refused_in_a_policy():
    with pytest.raises(PolicyError, match=r"policy.budget.gpu_memory: 24 bytes is no GPU's memory; .*24GB"):
        tiercache.load_policy({"name": "x", "budget": {"gpu_memory": 24}})
    with pytest.raises(PolicyError, match=r"policy.budget.gpu_memory: unknown unit 'XB'"):
        tiercache.load_policy({"name": "x", "budget": {"gpu_memory": "24XB"}})


def test_auto_walks_its_ladder_against_the_card():
    auto = {"name": "auto-card", "auto": True, "quantize": {"group_size": 64, "residual_length": 128},
            "budget": {"gpu_memory": "24GB", "host": "64GiB"}}
    p = plan(auto, "Llama-3-8B", 1, 131072)
    assert p.fits and p.whole.total["device"] <= 24 * GB
    first = p.rungs[0]  # full precision resident: 16 GiB of cache beside 15 GiB of weights
    assert first.verdict.startswith("rejected") and "> card" in first.verdict
    assert p.policy.name != "auto-card/fp-resident"
    # a cache-only budget of the same size would have let full precision through on the host tier
    cache_only = plan({**auto, "budget": {"device": "24GB", "host": "64GiB"}}, "Llama-3-8B", 1, 131072)
    assert cache_only.policy.name == "auto-card/fp-resident"


def test_fits_card_is_the_plans_card_verdict():
    ok, used = fits_card(RESIDENT_INT4, "Llama-3-8B", 1, 131072, 24 * GB)
    p = plan(RESIDENT_INT4, "Llama-3-8B", 1, 131072, gpu_memory=24 * GB)
    assert (ok, used) == (False, p.whole.total["device"])
    assert fits_card(RESIDENT_INT4, "Llama-3-8B", 1, 131072, 40 * GB)[0]
    # the card alone is judged: a cache budget the plan misses does not change the answer
    tight = {**RESIDENT_INT4, "budget": {"device": "1GiB"}}
    assert fits_card(tight, "Llama-3-8B", 1, 131072, 40 * GB)[0] and not plan(tight, "Llama-3-8B", 1, 131072).fits
    ok, used_int4w = fits_card(RESIDENT_INT4, "Llama-3-8B", 1, 131072, 24 * GB, weights="int4")
    assert ok and used_int4w < used  # the run's options reach the footprint
    with pytest.raises(PolicyError, match="no weight shapes"):
        fits_card(RESIDENT_INT4, ModelSpec("custom", 2, ("full_attention",) * 2, kv_heads=2, head_dim=8), 1, 64, GB)
    with pytest.raises(PolicyError, match="gpu_memory is the card's memory"):
        fits_card(RESIDENT_INT4, "Llama-3-8B", 1, 131072, None)
    assert tiercache.planner.fits_card is fits_card


def test_cli_plan_with_a_card(capsys):
    argv = ["plan", "configs/int4-kivi.yaml", "--model", "Llama-3-8B", "--context", "131072"]
    assert main(argv) == 0  # no card: the cache has no budget, nothing to check
    capsys.readouterr()
    assert main([*argv, "--gpu-memory", "24GB"]) == 1
    out = capsys.readouterr().out
    assert "card: whole footprint device" in out and "on a card of 24 GB (22.35 GiB): DOES NOT FIT" in out
    assert out.rstrip().endswith("verdict: does not fit")
    assert main([*argv, "--gpu-memory", "40GB"]) == 0
    assert "verdict: fits" in capsys.readouterr().out
    assert main([*argv, "--gpu-memory", "40GB", "--device", "cpu"]) == 1
    assert "the plan is for device 'cpu'" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["-5", "=-24GB", "0GB", "24", "24XB", "lots", "nanGB", "=-inf"])
def test_cli_gpu_memory_bad_input_names_the_allowed_forms(capsys, value):
    flag = ["--gpu-memory" + value] if value.startswith("=") else ["--gpu-memory", value]
    with pytest.raises(SystemExit) as e:
        main(["plan", "configs/int4-kivi.yaml", "--model", "Llama-3-8B", "--context", "1024", *flag])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --gpu-memory" in err and "24GB (10^9 bytes, as cards are sold)" in err and "GiB (2^30" in err


def test_card_size_messages_say_what_was_wrong():
    for text, why in (("-5GB", "positive"), ("24", "has no unit"), ("0GB", "0 bytes"), ("24XB", "expected a GPU's memory")):
        with pytest.raises(argparse.ArgumentTypeError, match=why):
            card_size(text)
