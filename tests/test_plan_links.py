"""``ringkv plan`` with the links given per level (``--link intra=...``, ``--link inter=...``,
``plan(links=...)``): parsing and its errors, what a link changes in the predictions, the
migration time, and the seeds' rules checked against ``plan()``'s output on the shapes
``benchmarks/hosts_plan.py`` measures (2 hosts x 2 ranks, CPU, links from 100 Mbit/s) and on
drawn ones. Fast: no hosts, no model."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ringkv import planner
from ringkv.__main__ import main
from ringkv.planner import SEED_MAX_PP, SEED_SP_TOKENS, plan

from benchmarks.hosts_plan import MODEL  # the engine model the benchmark measures

HOSTS_MODEL = dict(MODEL, model_type="llama", rms_norm_eps=1e-6, tie_word_embeddings=False)
CPU = dict(gpus=4, nodes=2, gpu="cpu", interconnect="loopback", dtype="float32")
INTRA = "intra=17.9gbit,30us"


def by_mesh(opts):
    return {(o.tp, o.pp, o.sp, o.ulysses): o for o in opts}


def test_rates_latencies_and_links_parse():
    assert planner.parse_rate("100mbit") == 12.5e6
    assert planner.parse_rate("1gbit") == 125e6
    assert planner.parse_rate("10gbit") == 1.25e9
    assert planner.parse_rate("2.5gbit") == 312.5e6
    assert planner.parse_rate("100mbps") == 100e6  # tc: bytes per second
    assert planner.parse_rate("1.25e9") == 1.25e9 and planner.parse_rate(5e8) == 5e8
    assert planner.parse_latency("20us") == pytest.approx(20e-6)
    assert planner.parse_latency("0.1ms") == pytest.approx(1e-4)
    assert planner.parse_latency("1s") == 1.0 and planner.parse_latency(0) == 0.0
    assert planner.parse_link("10gbit,20us") == (1.25e9, pytest.approx(20e-6))
    assert planner.parse_link("1gbit") == (125e6, 0.0)
    assert planner.parse_link((1e9, 5e-5)) == (1e9, 5e-5)
    got = planner.parse_links(["intra=10gbit,20us", "inter=1gbit,100us"])
    assert got == {"intra": (1.25e9, pytest.approx(2e-5)), "inter": (125e6, pytest.approx(1e-4))}
    assert planner.parse_links({"inter": (1e8, 1e-4)}) == {"inter": (1e8, 1e-4)}


@pytest.mark.parametrize(
    "links, match",
    [
        ({"outer": "1gbit"}, "unknown link level 'outer'; choose intra or inter"),
        ({"inter": "1gbyte"}, "use tc's units"),
        ({"inter": "0gbit"}, "must be > 0"),
        ({"inter": (0, 1e-5)}, "must be > 0"),
        ({"inter": (-1e9, 1e-5)}, "must be > 0"),
        ({"inter": "1gbit,5parsec"}, "give a time with its unit"),
        ({"inter": (1e9, -1e-5)}, "must be >= 0"),
        ({"inter": "1gbit,1us,3"}, "RATE\\[,LATENCY\\]"),
        ({"inter": 1e9}, "give \\(bytes_per_s, latency_s\\)"),
        (["inter"], "LEVEL=RATE"),
        (["inter=1gbit", "inter=10gbit"], "given twice"),
    ],
)
def test_bad_links_are_clear_value_errors(links, match):
    with pytest.raises(ValueError, match=match):
        plan(HOSTS_MODEL, 1024, links=links, **CPU)


def test_the_cli_takes_links_and_predicts_a_migration(tmp_path, capsys):
    out = tmp_path / "plan.json"
    argv = ["plan", "--model", "smollm2-135m", "--seq", "4096", "--gpus", "4", "--nodes", "2"]
    argv += ["--gpu", "cpu", "--interconnect", "loopback", "--dtype", "float32", "--top", "3"]
    argv += ["--link", INTRA, "--link", "inter=100mbit,100us", "--migrate-tokens", "1024"]
    assert main([*argv, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    got = json.loads(out.read_text())["migration"]
    # SmolLM2-135M: 30 layers x 3 KV heads x 64 x 2 (K, V) x 4 bytes = 46,080 B per token
    assert got["bytes"] == 1024 * 46080 and got["link"] == "inter"
    assert got["seconds"] == pytest.approx(1e-4 + 1024 * 46080 / 12.5e6)
    assert f"over the inter link: {got['seconds']:.3g} s" in text
    assert main(argv[:-6] + ["--link", "between=1gbit"]) == 2
    assert "unknown link level 'between'" in capsys.readouterr().err
    assert main(argv[:-4] + ["--migrate-tokens", "8"]) == 2  # no inter link given
    assert "--link inter=RATE,LATENCY" in capsys.readouterr().err


def test_a_link_overrides_the_table_and_only_its_axis_pays():
    """PP's hand-off crosses the hosts: a slower inter link adds exactly its bytes' time to each
    stage of the prefill, both TP ranks of a stage sending their hidden states over the host's
    one link at once; TP inside a host does not see it. The cpu entry has no 'ib': the inter
    link is what makes 2 nodes possible."""
    with pytest.raises(ValueError, match="--link inter=RATE,LATENCY"):
        plan(HOSTS_MODEL, 1024, **CPU)
    seq, h = 1024, HOSTS_MODEL["hidden_size"]
    slow = by_mesh(plan(HOSTS_MODEL, seq, links={"inter": "100mbit,50us"}, **CPU))
    fast = by_mesh(plan(HOSTS_MODEL, seq, links={"inter": "10gbit,50us"}, **CPU))
    a, b = slow[(2, 2, 1, 1)], fast[(2, 2, 1, 1)]
    assert a.links == dict(tp="loopback", ulysses="loopback", ring="loopback", pp="ib")
    handoff = seq * h * 4 * (1 / 12.5e6 - 1 / 1.25e9)  # tok x hidden x fp32, per stage
    assert a.prefill_s - b.prefill_s == pytest.approx(2 * 2 * handoff, rel=1e-9)  # 2 TP ranks
    # tp = 2 alone spans ranks 0, 1 (one host): the inter link does not change it
    assert slow[(2, 1, 2, 1)].links["tp"] == "loopback"
    # the intra link overrides the table's loopback (2e9 B/s): a slower one slows TP
    t1 = plan(HOSTS_MODEL, seq, links={"inter": "1gbit", "intra": "1gbit"}, **CPU)
    t2 = plan(HOSTS_MODEL, seq, links={"inter": "1gbit", "intra": "10gbit"}, **CPU)
    p1, p2 = by_mesh(t1), by_mesh(t2)
    assert p1[(2, 2, 1, 1)].prefill_s > p2[(2, 2, 1, 1)].prefill_s
    assert p1[(1, 4, 1, 1)].prefill_s == p2[(1, 4, 1, 1)].prefill_s


def test_the_engine_run_model_prices_each_axis_on_its_link():
    """``EngineRun(links=...)``: a one-step prefill of a tp=2 x pp=2 engine; slowing the inter
    link adds the hand-off's bytes (tokens x hidden x 4) over it, nothing else; on a link that
    is one per host (``Rates.shared``) the two TP ranks' hand-offs share it: twice that."""
    cfg = planner.load_model(HOSTS_MODEL)
    r = planner.rates(planner.load_hardware(), "cpu", "float32")
    assert r.shared == {}

    def seconds(inter: float, intra: float) -> float:
        r.links, r.latency = {"intra": intra, "inter": inter}, {"intra": 0.0, "inter": 0.0}
        run = planner.EngineRun(
            cfg=cfg, prompts=[512], max_tokens=1, num_blocks=64, measured_s=1.0, tp=2, pp=2,
            max_num_batched_tokens=512, links={"tp": "intra", "pp": "inter", "sp": "inter"},
        )  # fmt: skip
        return run.seconds(r)

    d_inter = seconds(12.5e6, 2e9) - seconds(1.25e9, 2e9)
    assert d_inter == pytest.approx(512 * 512 * 4 * (1 / 12.5e6 - 1 / 1.25e9), rel=1e-9)
    assert seconds(1.25e9, 1e8) > seconds(1.25e9, 2e9)  # TP's all-reduces are on intra
    r.shared = {"inter": True}
    assert seconds(12.5e6, 2e9) - seconds(1.25e9, 2e9) == pytest.approx(2 * d_inter, rel=1e-9)
    r.shared = {}
    tp_slow = seconds(1.25e9, 1e8)
    r.shared = {"intra": True}  # TP's own all-reduces do not share (one group per stage)
    assert seconds(1.25e9, 1e8) == pytest.approx(tp_slow, rel=1e-12)


def test_migration_time_is_the_request_kv_over_the_link():
    nbytes = planner.request_kv_bytes(HOSTS_MODEL, 2048, dtype="float32")
    assert nbytes == 2048 * 8 * 2 * 4 * 64 * 4  # tokens x layers x (K, V) x KV heads x D x 4
    t = planner.migration_time(HOSTS_MODEL, 2048, "1gbit,100us", dtype="float32")
    assert t == pytest.approx(1e-4 + nbytes / 125e6)
    # the ends' processing bounds it when the wire is faster; int8 K/V is smaller
    assert planner.migration_seconds(nbytes, 1e12, 0.0, host_rate=1e9) == nbytes / 1e9
    # on busy cores the ends' work adds to the wire instead of hiding behind it
    got = planner.migration_seconds(nbytes, 125e6, 1e-4, host_rate=1e9, overlap=False)
    assert got == pytest.approx(1e-4 + nbytes / 125e6 + nbytes / 1e9)
    assert planner.request_kv_bytes(HOSTS_MODEL, 2048, "int8", "float32") < nbytes
    with pytest.raises(ValueError, match="tokens must be a positive integer"):
        planner.migration_time(HOSTS_MODEL, 0, "1gbit")
    with pytest.raises(ValueError, match="must be > 0"):
        planner.migration_time(HOSTS_MODEL, 10, "0mbit")


def test_ring_backward_on_a_slow_link_pays_kv_and_gradients():
    r = planner.rates(planner.load_hardware(), "cpu", "float32")
    r.links, r.latency = {"inter": 12.5e6}, {"inter": 0.0}
    block = 2048 * 2 * 64 * 2  # tokens per rank x KV heads x D x (K, V)
    t = planner.ring_backward_seconds(8192, 8, 2, 64, 4, 4, r, "inter", step_s=1e-3)
    assert t == pytest.approx(1e-3 + 3 * block * 8 / 12.5e6 + block * 4 / 12.5e6)
    assert planner.ring_backward_seconds(8192, 8, 2, 64, 4, 4, r, "inter", step_s=10.0) == (
        pytest.approx(40.0 + block * 4 / 12.5e6)
    )


# -- the seeds' rules against plan()'s output -------------------------------------------------
def _recommended(opts):
    best = [o for o in opts if o.recommended]
    assert len(best) <= 1
    return best[0] if best else None


def check_seed_rules(opts, seq: int, nodes: int) -> None:
    """ "TP inside a host, PP across", "SP past 32K" and "PP <= 4" on one plan() output. Each
    rule is judged from the option's mesh and links (not its warnings): the recommendation breaks
    a rule only where every fitting option that keeps it breaks as many rules in all (the rules
    can conflict: SmolLM2's 9 heads allow no TP on 8 GPUs, so below 32K it takes PP 8 or SP)."""
    best = _recommended(opts)
    fit = [o for o in opts if o.fits]
    assert (best is None) == (not fit)
    if best is None:
        return
    n_rules = len(best.warnings)
    rules = {  # the rule, whether an option keeps it, the warning that says it breaks it
        "TP inside a node": (lambda o: o.links["tp"] != "ib", "crosses nodes"),
        "SP past 32K": (
            lambda o: (
                o.sp == 1
                or seq >= SEED_SP_TOKENS
                or not any(
                    p.fits and p.sp == 1 and p.kv_cache_dtype == o.kv_cache_dtype for p in opts
                )
            ),
            "SP does not pay yet",
        ),
        "PP <= 4": (lambda o: o.pp <= SEED_MAX_PP, f"> {SEED_MAX_PP}"),
    }
    for name, (keeps, warning) in rules.items():
        for o in fit:
            assert keeps(o) != any(warning in w for w in o.warnings), (name, o.warnings)
        if not keeps(best):
            better = [o for o in fit if keeps(o) and len(o.warnings) < n_rules]
            assert not better, (name, best.reason, better[0].reason)
    # on several hosts some axis crosses them: PP or SP when TP stays inside
    if nodes > 1 and best.links["tp"] != "ib":
        assert any(best.links[a] == "ib" for a in ("pp", "ring", "ulysses")), best.links


@pytest.mark.parametrize("rate", ["100mbit", "1gbit", "10gbit", "17.9gbit"])
@pytest.mark.parametrize("seq", [1024, 8192, 65536])
def test_seed_rules_on_the_measured_shapes(rate, seq):
    """2 hosts x 2 ranks as benchmarks/hosts_plan.py measures them: below 32K tokens the
    recommendation is tp = 2 inside a host with pp = 2 across (the mesh whose prefill and decode
    the benchmark times); past it SP crosses the hosts and TP stays inside."""
    opts = plan(HOSTS_MODEL, seq, links=[INTRA, f"inter={rate},50us"], **CPU)
    check_seed_rules(opts, seq, nodes=2)
    best = _recommended(opts)
    if seq < SEED_SP_TOKENS:
        assert (best.tp, best.pp, best.sp) == (2, 2, 1) and best.links["pp"] == "ib"
    else:
        assert best.sp > 1 and best.links["ring"] == "ib" and best.links["tp"] == "loopback"


def test_tp_across_a_slow_link_loses_on_the_time_model_alone():
    """The rule follows from the numbers, not only from its penalty: on a 100 Mbit/s inter link a
    TP group of 4 across the hosts (two all-reduces per layer over it) is predicted slower than
    tp = 2 inside with pp = 2 across (one hand-off per stage), in prefill and in decode."""
    opts = by_mesh(plan(HOSTS_MODEL, 1024, links=[INTRA, "inter=100mbit,50us"], **CPU))
    tp4, tp2pp2 = opts[(4, 1, 1, 1)], opts[(2, 2, 1, 1)]
    assert tp4.links["tp"] == "ib" and "crosses nodes" in tp4.reason
    assert tp4.prefill_s > tp2pp2.prefill_s and tp4.decode_step_s > tp2pp2.decode_step_s


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    model=st.sampled_from(["smollm2-135m", "qwen2.5-7b", "llama-3-8b", "llama-3-70b"]),
    per_node=st.sampled_from([2, 4, 8]),
    nodes=st.sampled_from([1, 2, 4]),
    seq=st.sampled_from([2048, 16384, 32768, 131072, 1 << 20]),
    inter=st.sampled_from(["100mbit", "1gbit", "10gbit", "100gbit", "400gbit"]),
    latency=st.sampled_from(["5us", "100us", "1ms"]),
    gpu=st.sampled_from(["h100", "4090", "l40s"]),
)
def test_seed_rules_on_drawn_clusters(model, per_node, nodes, seq, inter, latency, gpu):
    interconnect = "nvlink" if gpu == "h100" else "pcie"
    opts = plan(
        model,
        seq,
        gpus=per_node * nodes,
        nodes=nodes,
        gpu=gpu,
        interconnect=interconnect,
        links={"inter": f"{inter},{latency}"},
        output_tokens=64,
    )
    check_seed_rules(opts, seq, nodes)
    for o in opts:
        assert math.isfinite(o.prefill_s) and o.prefill_s > 0 and o.decode_step_s > 0
