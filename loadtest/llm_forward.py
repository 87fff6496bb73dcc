"""Time one forward call of a causal LM outside the server: prefill and decode step per dtype.

    python -m loadtest.llm_forward [--model-dir DIR] [--dtypes float32,bfloat16] [--threads 2] [--prompt 49]

Default model: the converted SmolLM2 in the build cache. Prints ms per prefill (batch 1 and 4,
full logits vs last position only) and per decode step (batch 1, 4, 16), each dtype after the
other in one run.
"""

from __future__ import annotations

import argparse
import time


def _ms(fn, repeat: int) -> float:
    fn()  # warm-up
    t = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t) / repeat * 1000


def main(argv: list[str] | None = None) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", default=None)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=49, help="prompt tokens")
    args = parser.parse_args(argv)
    if args.model_dir is None:
        from model_repository.llm import convert_smollm2

        args.model_dir = str(convert_smollm2())
    torch.set_num_threads(args.threads)
    for name in args.dtypes.split(","):
        model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=getattr(torch, name), attn_implementation="sdpa").eval()
        with torch.inference_mode():
            for keep in (0, 1):
                for batch in (1, 4):
                    ids = torch.randint(100, 1000, (batch, args.prompt))
                    ms = _ms(lambda: model(input_ids=ids, logits_to_keep=keep), 3)
                    print(f"{name:>9} prefill batch={batch} {'last-position logits' if keep else 'all logits':>20}: {ms:7.1f} ms")
            for batch in (1, 4, 16):
                ids = torch.randint(100, 1000, (batch, args.prompt))
                cache = model(input_ids=ids, use_cache=True).past_key_values
                token = torch.randint(100, 1000, (batch, 1))
                # the same position each time (cropped back): the step's cost, not a growing context
                ms = _ms(lambda: (model(input_ids=token, cache=cache, use_cache=True), cache.crop(-1)), 10)
                print(f"{name:>9} decode  batch={batch:<2}: {ms:7.1f} ms/step")


if __name__ == "__main__":
    main()
