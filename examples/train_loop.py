"""Train a small GPT-2 (or an MLP) for a few steps with remat's torch.compile backend.

The training loop is ordinary PyTorch: ``loss.backward()`` and ``torch.optim.AdamW``. The only
change is the backend: ``torch.compile(model, backend=remat.backend(budget=0.6))`` plans the
forward and backward graphs to fit 60% of the step's eager peak memory, recomputing what it
cannot keep (dropout masks included: recomputations replay the same random numbers).

    python examples/train_loop.py                    # GPT-2, 2 layers, remat at 60%
    python examples/train_loop.py --model mlp --method milp --budget 0.9
    python examples/train_loop.py --check            # also compare step 1 with eager PyTorch

Runs in well under a minute on a laptop CPU.
"""

from __future__ import annotations

import argparse
import copy
import logging
import time

import torch
import torch.nn.functional as F

import remat
from remat.cli_args import Parser, arg_type, backend_budget, method_name, positive_int, thread_count
from remat.cost import CostModel


def gpt2(args: argparse.Namespace):
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    config = GPT2Config(vocab_size=512, n_positions=args.seq, n_embd=128, n_layer=2, n_head=4, resid_pdrop=0.1,
                        embd_pdrop=0.1, attn_pdrop=0.1, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config).train()

    def batches():
        while True:
            ids = torch.randint(0, config.vocab_size, (args.batch, args.seq))
            yield (ids,)

    def loss_fn(model, ids):
        # An explicit attention mask: GPT-2's default masking branches on tensor values. No
        # key/value cache: training does not need it. The loss is computed here, not with
        # labels=: transformers' loss logs a warning once, which splits the compiled graph.
        logits = model(ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))

    return model, batches(), loss_fn


def mlp(args: argparse.Namespace):
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Dropout(0.1),
        torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Dropout(0.1),
        torch.nn.Linear(256, 10),
    )

    def batches():
        while True:
            yield torch.randn(args.batch * 32, 64), torch.randint(0, 10, (args.batch * 32,))

    return model, batches(), lambda model, x, y: F.cross_entropy(model(x), y)


def sequence_length(text: str) -> int:
    value = positive_int(text)
    if value < 2:
        raise ValueError(f"{value} must be at least 2 (the model predicts each next token)")
    return value


def main(argv: list[str] | None = None) -> None:
    # (remat's parser: a usage error is one line and exit code 2)
    parser = Parser(prog="train_loop.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("gpt2", "mlp"), default="gpt2", help="the model (default: gpt2)")
    parser.add_argument("--budget", type=arg_type(backend_budget), default="0.6",
                        help="bytes (1500000, 2GiB), a fraction (0.6) or a percentage (60%%) of the eager peak "
                             "(default: 0.6)")
    parser.add_argument("--method", type=arg_type(method_name), default="chen_greedy",
                        help="remat method (default: chen_greedy, quick; milp plans best, in seconds here; see "
                             "`remat methods`)")
    parser.add_argument("--steps", type=arg_type(positive_int), default=5, help="training steps (default: 5)")
    parser.add_argument("--batch", type=arg_type(positive_int), default=4, help="batch size (default: 4)")
    parser.add_argument("--seq", type=arg_type(sequence_length), default=64,
                        help="sequence length of the GPT-2's batches (default: 64)")
    parser.add_argument("--threads", type=thread_count(), default=1,
                        help="intra-op threads (default: 1, steady on a busy machine)")
    parser.add_argument("--check", action="store_true", help="compare the first step's gradients with eager PyTorch")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)

    model, batches, loss_fn = (gpt2 if args.model == "gpt2" else mlp)(args)
    # "0.6", "60%", "2GiB" or "1500000": remat reads a budget the same way everywhere
    backend = remat.backend(args.budget, method=args.method, cost_model=CostModel.PROFILE, cache_dir=None)
    # Compile the step's model call and loss together: remat plans one graph for both.
    step = torch.compile(lambda *batch: loss_fn(model, *batch), backend=backend)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    batch = next(batches)
    if args.check:
        reference = copy.deepcopy(model)
        torch.manual_seed(1)
        loss_fn(reference, *batch).backward()
    for i in range(args.steps):
        started = time.perf_counter()
        torch.manual_seed(1 + i)
        loss = step(*batch)
        loss.backward()
        if i == 0 and args.check:
            worst = max((p.grad - r.grad).abs().max().item() for p, r in zip(model.parameters(), reference.parameters()))
            print(f"step 1 gradients vs eager PyTorch: max |difference| = {worst:.3g}")
        optimizer.step()
        optimizer.zero_grad()
        print(f"step {i + 1}: loss {loss.item():.4f} ({time.perf_counter() - started:.2f} s)")
        batch = next(batches)
    print()
    for report in backend.reports:
        print(report)


if __name__ == "__main__":
    main()
