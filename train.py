"""specdistill: prepare -> capture -> train -> evaluate -> export, driven by Hydra.

    python train.py                       # the embedded default (SmolLM2-135M-Instruct) on CPU
    python train.py +exp=smoke            # a tiny random target, every stage in under a minute
    python train.py +exp=quick            # the embedded default on half the data, in ~40% of the time
    accelerate launch train.py +exp=llama8b
    python train.py stages=[evaluate] eval.limit=32
    python train.py -m +exp=quick train.lr=5e-4,1e-3   # a sweep: one run per job, data and features made once
"""

import hydra
from omegaconf import DictConfig

from specdistill.cli import exit_on_user_error, run_as_one_job, run_main
from specdistill.config import register, to_run_config
from specdistill.layout import RunLayout
from specdistill.pipeline import run_stages
from specdistill.summary import print_summary
from specdistill.sweep import named_for_its_job

register()


@hydra.main(config_path="conf", config_name="config", version_base=None)
def main(dict_cfg: DictConfig) -> float | None:
    """Returns the dev tau (rank 0), what a sweeper maximises."""
    cfg = exit_on_user_error(lambda: to_run_config(named_for_its_job(dict_cfg)))
    results = run_as_one_job(exit_on_user_error(lambda: RunLayout.of(cfg)).failed_dir, lambda: run_stages(cfg))
    if results is None:  # a rank other than 0: rank 0 speaks for the job
        return None
    print_summary(cfg, results)
    return results.get("evaluate", {}).get("tau")


if __name__ == "__main__":
    run_main(main)
