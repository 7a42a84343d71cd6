"""Real acceptance of a draft head: tau, speedup, lossless check, baselines and serving advice.

    python commands/evaluate.py head=runs/smollm2/ckpt/final bench=spec_bench limit=16 max_new_tokens=128 out=eval_out
    python commands/evaluate.py head=runs/smollm2/export/sglang bench=my.jsonl eval.batch_size=4 eval.temperature=0.7
    python commands/evaluate.py head=<dir> target=random bench=hf:<dataset dir>:test:prompt

A killed evaluation resumes: the same command re-uses the finished batches kept in `<out>/partial/`.
"""

import sys

import hydra
from omegaconf import DictConfig

from specdistill.cli import exit_on_user_error, run_main
from specdistill.evaluate.commands import head_override, register
from specdistill.evaluate.commands import main as evaluate_acceptance

register()


@hydra.main(config_path="../conf", config_name="acceptance", version_base=None)
def main(dict_cfg: DictConfig) -> None:
    exit_on_user_error(lambda: evaluate_acceptance(dict_cfg))


if __name__ == "__main__":
    sys.argv = head_override(sys.argv)
    run_main(main)
