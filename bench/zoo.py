"""Model zoo: `remat.optimize` on transformers architectures of many kinds, in float32 and under
bfloat16 autocast, each step checked against eager PyTorch tensor by tensor.

Every architecture is built from its transformers config at a size a CPU steps in about a
second (2 layers, width 64, random weights, no download), with the dropout its family has.
Each step is planned with `remat.optimize(model, batch, loss_fn, budget="50%", method="milp")`,
its defaults otherwise: costs profiled and kernel scratch measured on this machine (so the
overhead column varies a little between runs; memory and gradients do not);
where no plan fits 50% of the step's checkpoint-all peak (small models are mostly parameters),
it is planned at the smallest budget the error states, as a user would. The planned step and an
eager step then run once each from copies of the same weights with the same seed:

* gradients, loss, buffers and the random generator's state compared with `torch.equal`
  (`remat.verify`);
* the planned step's peak measured from torch.profiler's allocation events (parameters and
  batch included, kernel scratch included) against the predicted peak and the budget.

An architecture remat refuses is a row too, with the reason it gives.

    python bench/zoo.py                          # every architecture, about 16 minutes on 2 cores
    python bench/zoo.py --models swin,bloom --precisions bfloat16
    python bench/zoo.py --fresh                  # measure again what is stored

Results go to ``bench/results/zoo.json``, one entry per architecture and precision, written as
each is measured; a rerun measures only what is missing or was measured by another remat,
PyTorch or transformers version, or with other CPU kernels (``torch.backends.cpu.
get_cpu_capability()``: AVX2, AVX512, ...; which kernels run decides whether two runs of an op
round alike). ``markdown(results)`` renders the BENCHMARKS.md section.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "zoo.json"
PRECISIONS = ("float32", "bfloat16")
FRACTION = 0.5
TIME_LIMIT_S = 20.0
#: The bar for the measured peak: within this of the prediction.
PEAK_TOLERANCE = 0.02
MIB = 2**20

BATCH, SEQUENCE, VOCAB, CLASSES = 4, 64, 512, 10
SMALL = {"vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "intermediate_size": 128}


# ---------------------------------------------------------------------------- architectures
def _causal_lm(config: str, model: str, **kw) -> Callable:
    def build():
        import transformers as tf

        m = getattr(tf, model)(getattr(tf, config)(**kw))
        ids = _ids()
        return m, (ids,), lambda model, ids: model(input_ids=ids, labels=ids, use_cache=False).loss
    return build


def _classifier(config: str, model: str, **kw) -> Callable:
    def build():
        import torch
        import torch.nn.functional as F
        import transformers as tf

        m = getattr(tf, model)(getattr(tf, config)(num_labels=2, **kw))
        ids, labels = _ids(), torch.randint(0, 2, (BATCH,))
        return m, (ids, labels), lambda model, ids, y: F.cross_entropy(model(input_ids=ids).logits, y)
    return build


def _image(config: str, model: str, side: int = 32, **kw) -> Callable:
    def build():
        import torch
        import torch.nn.functional as F
        import transformers as tf

        m = getattr(tf, model)(getattr(tf, config)(num_labels=CLASSES, **kw))
        x, labels = torch.randn(BATCH, 3, side, side), torch.randint(0, CLASSES, (BATCH,))
        return m, (x, labels), lambda model, x, y: F.cross_entropy(model(pixel_values=x).logits, y)
    return build


def _bart():
    import torch
    import transformers as tf

    config = tf.BartConfig(vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                           decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, dropout=0.1)
    ids, labels = torch.randint(4, VOCAB, (BATCH, SEQUENCE)), torch.randint(4, VOCAB, (BATCH, SEQUENCE // 2))
    return (tf.BartForConditionalGeneration(config), (ids, labels),
            lambda model, ids, y: model(input_ids=ids, labels=y).loss)


def _whisper():
    import torch
    import transformers as tf

    config = tf.WhisperConfig(vocab_size=VOCAB, num_mel_bins=16, encoder_layers=2, decoder_layers=2,
                              encoder_attention_heads=4, decoder_attention_heads=4, d_model=64, encoder_ffn_dim=128,
                              decoder_ffn_dim=128, max_source_positions=64, max_target_positions=64, dropout=0.1,
                              decoder_start_token_id=1, pad_token_id=0)
    features, labels = torch.randn(BATCH, 16, 128), torch.randint(2, VOCAB, (BATCH, 16))
    return (tf.WhisperForConditionalGeneration(config), (features, labels),
            lambda model, f, y: model(input_features=f, labels=y).loss)


def _wav2vec2(layerdrop: float) -> Callable:
    def build():
        import torch
        import torch.nn.functional as F
        import transformers as tf

        config = tf.Wav2Vec2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                   conv_dim=(32, 32, 32), conv_stride=(5, 2, 2), conv_kernel=(10, 3, 3),
                                   num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, num_labels=4,
                                   hidden_dropout=0.1, attention_dropout=0.1, feat_proj_dropout=0.1,
                                   mask_time_prob=0.0, layerdrop=layerdrop)
        audio, labels = torch.randn(BATCH, 1600), torch.randint(0, 4, (BATCH,))
        return (tf.Wav2Vec2ForSequenceClassification(config), (audio, labels),
                lambda model, x, y: F.cross_entropy(model(input_values=x).logits, y))
    return build


def _clip():
    import torch
    import transformers as tf

    config = tf.CLIPConfig(
        text_config={"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "max_position_embeddings": SEQUENCE},
        vision_config={"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                       "image_size": 32, "patch_size": 8},
        projection_dim=32)
    ids, pixels = _ids(), torch.randn(BATCH, 3, 32, 32)
    return tf.CLIPModel(config), (ids, pixels), lambda model, ids, x: model(input_ids=ids, pixel_values=x,
                                                                           return_loss=True).loss


def _t5():
    import torch
    import transformers as tf

    config = tf.T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                         dropout_rate=0.1, decoder_start_token_id=0, pad_token_id=0)
    ids, labels = _ids(), torch.randint(1, VOCAB, (BATCH, SEQUENCE // 2))
    return (tf.T5ForConditionalGeneration(config), (ids, labels),
            lambda model, ids, y: model(input_ids=ids, labels=y).loss)


def _vit_mae():
    import torch
    import transformers as tf

    config = tf.ViTMAEConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                             image_size=32, patch_size=8, decoder_hidden_size=32, decoder_num_hidden_layers=1,
                             decoder_num_attention_heads=4, decoder_intermediate_size=64, mask_ratio=0.75)
    return tf.ViTMAEForPreTraining(config), (torch.randn(BATCH, 3, 32, 32),), lambda model, x: model(pixel_values=x).loss


def _ids():
    import torch

    return torch.randint(0, VOCAB, (BATCH, SEQUENCE))


_NO_HEADS = {k: v for k, v in SMALL.items() if k != "vocab_size"}

#: name -> (what it exercises, builder)
ARCHITECTURES: dict[str, tuple[str, Callable]] = {
    "mistral": ("grouped-query attention, sliding-window mask, RMSNorm, SwiGLU",
                _causal_lm("MistralConfig", "MistralForCausalLM", num_key_value_heads=2, **SMALL)),
    "qwen2": ("grouped-query attention with biases, rotary embeddings",
              _causal_lm("Qwen2Config", "Qwen2ForCausalLM", num_key_value_heads=2, **SMALL)),
    "gemma": ("GeGLU, scaled embeddings, RMSNorm with an offset",
              _causal_lm("GemmaConfig", "GemmaForCausalLM", num_key_value_heads=2, head_dim=16, **SMALL)),
    "phi3": ("fused QKV and gate-up projections, rotary embeddings",
             _causal_lm("Phi3Config", "Phi3ForCausalLM", pad_token_id=0, **SMALL)),
    "gpt-neox": ("parallel residual, partial rotary embeddings, dropout 0.1",
                 _causal_lm("GPTNeoXConfig", "GPTNeoXForCausalLM", hidden_dropout=0.1, attention_dropout=0.1,
                            **SMALL)),
    "gpt-j": ("parallel attention and MLP, interleaved rotary embeddings",
              _causal_lm("GPTJConfig", "GPTJForCausalLM", vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4,
                         rotary_dim=8)),
    "opt": ("learned positions with an offset, ReLU MLP, dropout 0.1",
            _causal_lm("OPTConfig", "OPTForCausalLM", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                       num_attention_heads=4, ffn_dim=128, word_embed_proj_dim=64, dropout=0.1)),
    "bloom": ("ALiBi attention biases, embedding layer norm, dropout 0.1",
              _causal_lm("BloomConfig", "BloomForCausalLM", vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4,
                         hidden_dropout=0.1, attention_dropout=0.1)),
    "falcon": ("multi-query attention, parallel attention and MLP",
               _causal_lm("FalconConfig", "FalconForCausalLM", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                          num_attention_heads=4)),
    "distilbert": ("encoder classifier, dropout 0.1",
                   _classifier("DistilBertConfig", "DistilBertForSequenceClassification", vocab_size=VOCAB, dim=64,
                               n_layers=2, n_heads=4, hidden_dim=128)),
    "roberta": ("encoder classifier, padding-offset positions, dropout 0.1",
                _classifier("RobertaConfig", "RobertaForSequenceClassification", max_position_embeddings=SEQUENCE + 2,
                            **SMALL)),
    "albert": ("one layer's weights shared by every layer, factorized embeddings",
               _classifier("AlbertConfig", "AlbertForSequenceClassification", embedding_size=32, **SMALL)),
    "electra": ("factorized embeddings projected to the width, dropout 0.1",
                _classifier("ElectraConfig", "ElectraForSequenceClassification", embedding_size=32, **SMALL)),
    "bart": ("encoder-decoder with cross-attention, dropout 0.1", _bart),
    "whisper": ("convolutional audio front end, encoder-decoder, dropout 0.1", _whisper),
    "wav2vec2": ("convolutional feature encoder with group norm, convolutional positions, LayerDrop off",
                 _wav2vec2(0.0)),
    "wav2vec2-layerdrop": ("as above with transformers' default LayerDrop 0.1: a random Python branch",
                           _wav2vec2(0.1)),
    "clip": ("two towers and a contrastive loss over the batch", _clip),
    "swin": ("shifted windows (rolls, window partitions), patch merging",
             _image("SwinConfig", "SwinForImageClassification", image_size=32, patch_size=2, embed_dim=16,
                    depths=[2, 2], num_heads=[2, 4], window_size=4)),
    "segformer": ("overlapping patch embeddings (convolutions), spatial-reduction attention, Mix-FFN",
                  _image("SegformerConfig", "SegformerForImageClassification", num_encoder_blocks=2, depths=[1, 1],
                         sr_ratios=[2, 1], hidden_sizes=[16, 32], num_attention_heads=[1, 2], mlp_ratios=[2, 2],
                         patch_sizes=[7, 3], strides=[4, 2])),
    "mobilevit": ("inverted residuals with batch norm, unfold/fold around transformer blocks",
                  _image("MobileViTConfig", "MobileViTForImageClassification", side=64, image_size=64,
                         hidden_sizes=[32, 48, 64], neck_hidden_sizes=[8, 16, 24, 24, 32, 40, 160])),
    "resnet": ("transformers' ResNet: convolutions, batch norm, max pooling",
               _image("ResNetConfig", "ResNetForImageClassification", embedding_size=16, hidden_sizes=[16, 32],
                      depths=[1, 1])),
    "deit": ("distillation token, two heads averaged",
             _image("DeiTConfig", "DeiTForImageClassification", image_size=32, patch_size=8, **_NO_HEADS)),
    "t5": ("relative position buckets, RMS layer norm, encoder-decoder, dropout 0.1", _t5),
    "mamba": ("selective state-space scan (the reference PyTorch loop), causal depthwise convolution",
              _causal_lm("MambaConfig", "MambaForCausalLM", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                         state_size=8)),
    "convnext": ("depthwise convolutions, channels-last layer norm, stochastic depth 0.2 (random per sample)",
                 _image("ConvNextConfig", "ConvNextForImageClassification", hidden_sizes=[16, 32], depths=[1, 1],
                        num_stages=2, drop_path_rate=0.2, image_size=32)),
    "beit": ("relative position bias from a cached index, stochastic depth 0.1, layer scale",
             _image("BeitConfig", "BeitForImageClassification", image_size=32, patch_size=8, drop_path_rate=0.1,
                    use_relative_position_bias=True, **_NO_HEADS)),
    "vit-mae": ("random masking (noise, argsort, gather) and a reconstruction loss", _vit_mae),
    "mixtral": ("mixture of experts: top-2 of 4 routed experts (grouped products), load-balancing loss",
                _causal_lm("MixtralConfig", "MixtralForCausalLM", num_key_value_heads=2, num_local_experts=4,
                           num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.02, **SMALL)),
    "qwen2-moe": ("mixture of experts with a gated shared expert, top-2 of 4, load-balancing loss",
                  _causal_lm("Qwen2MoeConfig", "Qwen2MoeForCausalLM", num_key_value_heads=2, num_experts=4,
                             num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
                             output_router_logits=True, router_aux_loss_coef=0.02, **SMALL)),
}


# ---------------------------------------------------------------------------- measuring
def _autocast(loss_fn: Callable, precision: str) -> Callable:
    if precision == "float32":
        return loss_fn
    import torch

    def under_autocast(model, *batch):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return loss_fn(model, *batch)
    return under_autocast


def measure(name: str, precision: str, time_limit_s: float) -> dict:
    """Plan, run and compare one architecture at one precision: the record of one row."""
    import torch

    import remat
    from remat.verify import compare, eager_step, planned_step

    torch.manual_seed(0)
    model, batch, loss_fn = ARCHITECTURES[name][1]()
    model.train()
    loss_fn = _autocast(loss_fn, precision)
    row: dict = {"model": name, "precision": precision, "fraction": FRACTION}
    started = time.perf_counter()
    budget = f"{FRACTION:.0%}"
    try:
        try:
            step = remat.optimize(model, batch, loss_fn, budget=budget, method="milp", time_limit_s=time_limit_s)
        except remat.InfeasibleBudgetError as exc:
            row["stated_minimum"] = True
            budget = exc.min_budget_bytes
            step = remat.optimize(model, batch, loss_fn, budget=budget, method="milp", time_limit_s=time_limit_s)
    except remat.RematError as exc:
        row.update(refused=f"{type(exc).__name__}: {exc}", wall_s=round(time.perf_counter() - started, 1))
        return row
    report = step.report
    row.update(plan_s=round(time.perf_counter() - started, 1), n_nodes=report.n_nodes,
               checkpoint_all_peak_bytes=report.checkpoint_all_peak_bytes, budget_bytes=report.budget_bytes,
               predicted_peak_bytes=report.predicted_peak_bytes, overhead=report.overhead, gap=report.gap,
               status=report.status.value, method=report.method)
    want, eager_memory = eager_step(model, batch, loss_fn)
    got, planned_memory = planned_step(model, batch, step.traced, step.planned)
    agreement = compare(got, want)
    row.update(eager_peak_bytes=eager_memory.peak_bytes, measured_peak_bytes=planned_memory.peak_bytes,
               peak_error=planned_memory.peak_bytes / report.predicted_peak_bytes - 1,
               within_budget=planned_memory.peak_bytes <= report.budget_bytes, bitwise=agreement.bitwise,
               max_abs_diff=agreement.max_abs_diff, mismatches=list(agreement.mismatches[:3]),
               wall_s=round(time.perf_counter() - started, 1))
    return row


def _versions() -> dict:
    import torch
    import transformers

    from remat.solvers import planner_version

    # (the CPU kernels PyTorch dispatches to: bitwise agreement with eager is a property of them)
    return {"planner": planner_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "kernels": torch.backends.cpu.get_cpu_capability()}


def run(names: list[str], precisions: list[str], time_limit_s: float, out: Path, fresh: bool) -> dict:
    from remat.sweep import save_json

    results = json.loads(out.read_text()) if out.exists() else {"meta": {}, "rows": {}}
    versions = _versions()
    results["meta"].update(time_limit_s=time_limit_s, **versions)
    for name in names:
        for precision in precisions:
            key = f"{name}/{precision}"
            stored = results["rows"].get(key)
            if stored and not fresh and stored.get("versions") == versions and stored.get("time_limit_s") == time_limit_s:
                print(f"{key}: stored", flush=True)
                continue
            row = measure(name, precision, time_limit_s)
            row.update(versions=versions, time_limit_s=time_limit_s)
            results["rows"][key] = row
            save_json(results, out)
            print(f"{key}: {_summary(row)}", flush=True)
    return results


def _summary(row: dict) -> str:
    if "refused" in row:
        return f"refused: {row['refused']}"
    grads = "bitwise" if row["bitwise"] else f"max |diff| {row['max_abs_diff']:.2g} ({'; '.join(row['mismatches'])})"
    return (f"budget {row['budget_bytes'] / MIB:.2f} MiB, predicted {row['predicted_peak_bytes'] / MIB:.2f}, measured "
            f"{row['measured_peak_bytes'] / MIB:.2f} ({row['peak_error']:+.2%}), overhead {row['overhead']:.3f}x, {grads}")


# ---------------------------------------------------------------------------- report
def markdown(results: dict) -> str:
    meta = results.get("meta", {})
    lines = [
        "## Model zoo: transformers architectures in float32 and bfloat16 autocast (`bench/zoo.py`)",
        "",
        f"Command: `python bench/zoo.py` (torch {meta.get('torch', '?')}"
        + (f" with {meta['kernels']} CPU kernels" if meta.get("kernels") else "")
        + f", transformers {meta.get('transformers', '?')}, "
        f"`milp` with a {meta.get('time_limit_s', '?')} s limit, profiled costs, measured kernel scratch). Each architecture is built from its transformers "
        f"config (2 layers, width 64, random weights, its family's dropout; batch {BATCH}, {SEQUENCE} tokens or "
        f"32-64 pixel images) and planned with `remat.optimize(..., budget=\"{FRACTION:.0%}\", method=\"milp\")`; "
        f"where no plan fits {FRACTION:.0%} of the step's checkpoint-all peak (\\* in the budget column: small models "
        f"are mostly parameters) it is planned at the smallest budget the error states. bfloat16: the loss function "
        f"runs under `torch.autocast(\"cpu\", dtype=torch.bfloat16)`. The planned step and an eager step run once "
        f"each from the same weights and seed; gradients, loss, buffers and the random generator's state are "
        f"compared with `torch.equal`; measured = torch.profiler's allocation events (parameters and batch "
        f"included, kernel scratch included).",
        "",
        "| model | exercises | precision | nodes | checkpoint-all MiB | budget MiB | predicted MiB | measured MiB | "
        "error | within budget | overhead | gap | vs eager |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---|",
    ]
    rows = results.get("rows", {})
    n = bitwise = over = 0
    worst = 0.0
    refused = []
    for key in sorted(rows, key=lambda k: (list(ARCHITECTURES).index(k.split("/")[0]) if k.split("/")[0] in ARCHITECTURES
                                           else len(ARCHITECTURES), k)):
        row = rows[key]
        what = ARCHITECTURES.get(row["model"], ("",))[0]
        if "refused" in row:
            refused.append(row["model"])
            lines.append(f"| {row['model']} | {what} | {row['precision']} | | | | | | | | | | refused: "
                         f"{row['refused'].split(': ', 1)[-1].replace('|', '/')} |")
            continue
        n += 1
        bitwise += row["bitwise"]
        over += not row["within_budget"]
        worst = max(worst, abs(row["peak_error"]))
        star = "\\*" if row.get("stated_minimum") else ""
        gap = f"{row['gap']:.2%}" if row.get("gap") is not None else "-"
        versus = "bitwise" if row["bitwise"] else f"max abs diff {row['max_abs_diff']:.1e}"
        lines.append(
            f"| {row['model']} | {what} | {row['precision']} | {row['n_nodes']} | "
            f"{row['checkpoint_all_peak_bytes'] / MIB:.2f} | {row['budget_bytes'] / MIB:.2f}{star} | "
            f"{row['predicted_peak_bytes'] / MIB:.2f} | {row['measured_peak_bytes'] / MIB:.2f} | {row['peak_error']:+.2%} | "
            f"{'yes' if row['within_budget'] else 'NO'} | {row['overhead']:.3f}x | {gap} | {versus} |")
    lines += ["", f"{n} planned steps: {bitwise} bitwise equal to eager PyTorch; largest |measured - predicted| / "
                  f"predicted = {worst:.2%} ({'within' if worst <= PEAK_TOLERANCE else 'OVER'} the "
                  f"{PEAK_TOLERANCE:.0%} bar); measured above the budget in {over}."
              + (f" Refused, with the reason shown: {', '.join(sorted(set(refused)))}." if refused else ""), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from remat.cli_args import Parser, UsageError, thread_count, writable_file

    # (remat's parser: a usage error is one line, exit code 2, checked before any work)
    parser = Parser(prog="zoo.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(ARCHITECTURES),
                        help=f"comma-separated models, from: {', '.join(ARCHITECTURES)} (default: all of them)")
    parser.add_argument("--precisions", default=",".join(PRECISIONS),
                        help=f"comma-separated, from: {', '.join(PRECISIONS)} (default: both)")
    parser.add_argument("--time-limit", type=float, default=TIME_LIMIT_S,
                        help="seconds per milp solve (default %(default)g)")
    parser.add_argument("--threads", type=thread_count(), default=2, help="intra-op threads (default %(default)s)")
    parser.add_argument("--out", type=Path, default=RESULTS,
                        help="the results JSON, kept between runs (default bench/results/zoo.json)")
    parser.add_argument("--fresh", action="store_true", help="measure again what is stored")
    args = parser.parse_args(argv)
    names = [m for m in args.models.split(",") if m]
    precisions = [p for p in args.precisions.split(",") if p]
    unknown = [m for m in names if m not in ARCHITECTURES]
    if unknown or not names:
        parser.error(f"--models: unknown model(s) {', '.join(unknown) or '(none given)'}; "
                     f"choose from {', '.join(ARCHITECTURES)}")
    if not precisions or any(p not in PRECISIONS for p in precisions):
        parser.error(f"--precisions: unknown precision in {args.precisions!r}; choose from {', '.join(PRECISIONS)}")
    if not (args.time_limit > 0 and math.isfinite(args.time_limit)):
        parser.error(f"--time-limit must be a positive number of seconds, not {args.time_limit:g}")
    try:
        writable_file(args.out, "--out")
        if args.out.exists():
            json.loads(args.out.read_text())
    except UsageError as exc:
        parser.error(str(exc))
    except ValueError as exc:  # (a file that is not this benchmark's JSON: its results would be lost)
        parser.error(f"--out {str(args.out)!r} is not a results file of this benchmark (not readable JSON: {exc})")
    import warnings

    import torch
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(args.threads)
    hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)
    results = run(names, precisions, args.time_limit, args.out, args.fresh)
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
