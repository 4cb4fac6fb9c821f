"""Encoder, classifier, aux-loss plumbing, the benchmark and the command line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from clusterformer.attention import collect_aux_losses, total_loss
from clusterformer.cli import main
from clusterformer.models import Encoder, EncoderConfig, SequenceClassifier
from reference import run_recorded


def _config(**overrides):
    base = dict(vocab_size=30, dim=16, depth=3, heads=2, dropout=0.0, attention="neural-clustering",
                attention_options={"num_clusters": 3})
    base.update(overrides)
    return EncoderConfig(**base)


def test_aux_losses_are_the_mean_over_layers():
    model = SequenceClassifier(_config(), num_classes=3)
    tokens = torch.randint(1, 30, (2, 11))
    inputs = []  # what each attention layer was called with, to run it again alone
    hooks = [block.attn.register_forward_hook(lambda m, args, kwargs, out: inputs.append((m, args, kwargs)),
                                              with_kwargs=True) for block in model.encoder.blocks]
    with collect_aux_losses() as aux:
        model(tokens)
    for hook in hooks:
        hook.remove()
    depth = len(model.encoder.blocks)
    assert depth > 1 and aux.counts() == {"clustering": depth, "centroid_sorting": depth}
    alone = [run_recorded(layer, *args, **kwargs)[1] for layer, args, kwargs in inputs]
    for name in ("clustering", "centroid_sorting"):
        expected = torch.stack([layer_aux[name] for layer_aux in alone]).mean()
        torch.testing.assert_close(aux[name], expected)
    total = total_loss(torch.tensor(2.0), aux, {"clustering": 0.5, "centroid_sorting": 0.25}, task_weight=3.0)
    torch.testing.assert_close(total, 6.0 + 0.5 * aux["clustering"] + 0.25 * aux["centroid_sorting"])
    with collect_aux_losses() as none:
        SequenceClassifier(_config(attention="full", attention_options={}), 2)(tokens)
    assert dict(none) == {}
    with pytest.raises(ValueError, match="loss weight 'clustering' must be >= 0"):
        total_loss(torch.tensor(1.0), aux, {"clustering": -1.0})
    with pytest.raises(ValueError, match="loss weight 'clusterin' names no auxiliary loss; known losses: "
                                         "centroid_sorting, clustering, commitment"):
        total_loss(torch.tensor(1.0), aux, {"clusterin": 0.5})  # a misspelled weight must not do nothing
    # a known loss this model does not publish adds nothing
    torch.testing.assert_close(total_loss(torch.tensor(1.0), {}, {"commitment": 1.0}), torch.tensor(1.0))


def test_centroid_flow_passes_updated_centroids_between_layers():
    model = Encoder(_config(centroid_flow=True))
    attn = [block.attn for block in model.blocks]
    assert attn[0].inner.centroids is not None and all(a.inner.centroids is None for a in attn[1:])
    flows_in, flows_out = [], []

    def record(module, args, kwargs, out) -> None:
        flows_in.append(kwargs["flow"])
        flows_out.append(out[1])

    hooks = [a.register_forward_hook(record, with_kwargs=True) for a in attn]
    tokens = torch.randint(1, 30, (2, 9))
    out, aux, _ = run_recorded(model, tokens)
    for hook in hooks:
        hook.remove()
    assert flows_in[0] is None and flows_in[1] is flows_out[0]  # layer 2 starts from layer 1's C_hat
    loss = out.sum() + sum(aux.values())
    loss.backward()
    assert attn[0].inner.centroids.grad is not None and attn[0].inner.centroids.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="leak future tokens"):
        model(tokens, causal=True)  # strict causal mode refuses centroids from another layer


@pytest.mark.parametrize("attention", ["full", "neural-clustering"])
def test_classifier_ignores_padding(attention):
    model = SequenceClassifier(_config(attention=attention, attention_options={}), num_classes=2).eval()
    tokens = torch.randint(1, 30, (3, 14))
    pad = torch.zeros(3, 14, dtype=torch.bool)
    pad[0, 9:] = True
    logits = model(tokens, pad)
    changed = tokens.clone()
    changed[pad] = torch.randint(1, 30, (int(pad.sum()),))
    torch.testing.assert_close(model(changed, pad), logits)


def test_encoder_config_errors():
    with pytest.raises(ValueError, match="unknown attention mechanism 'nope'"):
        _config(attention="nope")
    with pytest.raises(ValueError, match="unknown option 'clusters'"):
        _config(attention_options={"clusters": 3})
    with pytest.raises(ValueError, match="centroid_flow needs attention='neural-clustering'"):
        _config(attention="full", attention_options={}, centroid_flow=True)
    with pytest.raises(ValueError, match="positional must be one of"):
        _config(positional="rotary")
    model = Encoder(_config(positional="learned", max_len=8))
    with pytest.raises(ValueError, match="max_len=8"):
        model(torch.randint(1, 30, (1, 9)))
    with pytest.raises(ValueError, match="tokens must be an integer tensor"):
        model(torch.randn(1, 5))


def test_bench_cli_writes_records_and_plot(tmp_path, capsys):
    out, plot = tmp_path / "b.json", tmp_path / "b.png"
    code = main(["bench", "attention", "--names", "full,neural-clustering", "--lengths", "64,96", "--repeats", "1",
                 "--warmup", "0", "--json", str(out), "--plot", str(plot)])
    assert code == 0
    records = json.loads(out.read_text())
    assert len(records) == 4
    keys = {"name", "length", "batch", "heads", "head_dim", "device", "fwd_ms", "fwd_bwd_ms", "peak_mem_mb"}
    for record in records:
        assert keys <= set(record)
        assert record["fwd_ms"] > 0 and record["fwd_bwd_ms"] > 0 and record["peak_mem_mb"] >= 0
    assert {r["name"] for r in records} == {"full", "neural-clustering"}
    assert [r["fwd_bwd_aux_ms"] is None for r in records if r["name"] == "full"] == [True, True]
    assert plot.stat().st_size > 1000
    assert "[4/4] neural-clustering N=96" in capsys.readouterr().err  # progress


def test_bench_padded_batches(tmp_path, capsys):
    """--padding: sequence b of the batch right-padded by padding * N * b / (B - 1) tokens; recorded."""
    from clusterformer.bench.attention import padding_mask

    assert padding_mask(3, 10, 0.0) is None
    assert (~padding_mask(3, 10, 0.6)).sum(1).tolist() == [10, 7, 4]
    assert (~padding_mask(1, 10, 0.3)).sum(1).tolist() == [7]
    out = tmp_path / "p.json"
    assert main(["bench", "attention", "--names", "lsh", "--lengths", "64", "--batch", "2", "--padding", "0.5",
                 "--repeats", "1", "--warmup", "0", "--json", str(out)]) == 0
    (record,) = json.loads(out.read_text())
    assert record["padding"] == 0.5 and record["batch"] == 2 and record["fwd_ms"] > 0
    with pytest.raises(SystemExit):
        main(["bench", "attention", "--names", "lsh", "--lengths", "64", "--padding", "1.5"])
    assert "padding must be < 1.0" in capsys.readouterr().err


def test_bench_reversible_and_report_cli(tmp_path, capsys):
    out = tmp_path / "rev.json"
    code = main(["bench", "reversible", "--depths", "1,2", "--attention", "lsh", "--length", "32", "--dim", "16",
                 "--heads", "2", "--repeats", "1", "--json", str(out)])
    assert code == 0
    records = json.loads(out.read_text())
    assert [(r["depth"], r["reversible"]) for r in records] == [(1, False), (1, True), (2, False), (2, True)]
    assert all(r["fwd_bwd_ms"] > 0 and r["attention"] == "lsh" for r in records)
    capsys.readouterr()
    assert main(["bench", "report", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert table.startswith("| depth |") and len(table.splitlines()) == 4
    bench = tmp_path / "att.json"
    main(["bench", "attention", "--names", "full,lsh", "--lengths", "32", "--repeats", "1", "--warmup", "0",
          "--json", str(bench)])
    capsys.readouterr()
    main(["bench", "report", "--json", str(bench)])
    rows = capsys.readouterr().out.splitlines()
    assert rows[2].startswith("| full | 32 |") and rows[2].endswith("| 1.0x | 1.0x |")
    assert rows[3].startswith("| lsh | 32 |")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "attention", "--names", "full,bogus"], "unknown attention name"),
        (["bench", "report", "--json", "/nonexistent.json"], "is not a file"),
        (["bench", "reversible", "--attention", "bogus"], "unknown attention name"),
        (["bench", "attention", "--lengths", "0"], "expected positive integers"),
        (["bench", "attention", "--options", '{"full": {"look_back": 1}}', "--lengths", "8"], "unknown option"),
    ],
)
def test_cli_rejects_bad_arguments_clearly(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_module_entry_point_lists_mechanisms():
    result = subprocess.run([sys.executable, "-m", "clusterformer", "list"], capture_output=True, text=True,
                            check=True)
    assert "neural-clustering" in result.stdout and "causal_mode = 'strict'" in result.stdout


def test_demo_runs_end_to_end_on_a_tiny_budget(tmp_path):
    from clusterformer.demo import DemoConfig, majority_marker_batch, run_demo

    tokens, labels = majority_marker_batch(64, 40, torch.Generator().manual_seed(0))
    a, b = (tokens == 40).sum(1), (tokens == 41).sum(1)
    assert torch.equal(labels, (a > b).long()) and (a != b).all() and (a >= 1).all() and (b >= 1).all()
    lines = []
    summary = run_demo(tmp_path, DemoConfig(length=32, train_steps=2, batch=4, eval_examples=8, dim=16,
                                            bench_lengths=(32,)), log=lines.append)
    assert {r["attention"] for r in summary["training"]} == {"full", "neural-clustering"}
    assert (tmp_path / "demo.json").exists() and (tmp_path / "bench.png").exists()
    assert any("speed-up" in line for line in lines)


@pytest.mark.parametrize("name", ["lsh", "kmeans", "routing", "clustered"])
def test_each_layer_gets_its_own_seed(name):
    """Issue #12: layers of a model must not share hash rotations / planes / initial centroids. Layer 1's
    parameters (not its seeded buffers or generator) are copied into layer 0; with a shared seed the two
    would then compute the same function."""
    from clusterformer.models import Encoder, EncoderConfig

    config = EncoderConfig(vocab_size=30, dim=32, depth=2, heads=2, attention=name,
                           attention_options={"seed": 3})
    tokens = torch.randint(1, 30, (2, 40), generator=torch.Generator().manual_seed(2))
    torch.manual_seed(0)
    model = Encoder(config).eval()
    torch.manual_seed(0)
    again = Encoder(config).eval()
    with torch.no_grad():  # a fixed seed still reproduces the whole model
        assert torch.equal(model(tokens), again(tokens))
    first, second = (block.attn for block in model.blocks)
    assert first.inner.seed != second.inner.seed
    with torch.no_grad():
        for p_first, p_second in zip(first.parameters(), second.parameters(), strict=True):
            p_first.copy_(p_second)
        x = torch.randn(2, 150, 32, generator=torch.Generator().manual_seed(1))
        assert not torch.allclose(first(x), second(x))
