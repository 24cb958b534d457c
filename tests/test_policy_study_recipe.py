"""experiment=policy_study: the grid it expands to, device tiers sized for the attended budget, and
real SmolLM2 runs whose decode steps attend exactly the budget (recall and eviction)."""

import math

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from kvtier.budget import TokenBudget
from kvtier.build import plan
from kvtier.run import RECIPES, execute, job_configs

STUDY = ["experiment=policy_study", "logger=none"]


def test_the_grid_and_a_command_line_value_replacing_a_swept_key():
    params = OmegaConf.load(RECIPES / "experiment" / "policy_study.yaml").hydra.sweeper.params
    assert [len(str(v).split(",")) for v in params.values()] == [5, 2, 4, 4]  # tasks x scopes x policies x budgets
    assert str(params["budget.fraction"]) == "0.05,0.1,0.2,0.5"
    one = list(job_configs([*STUDY, "task=study/needle", "scope=topk", "policy=snapkv", "budget.fraction=0.2"]))
    assert len(one) == 1 and one[0].task.text == "lady_susan"
    assert one[0].cache.attend_budget and one[0].cache.exact_prefill


def test_device_tier_holds_what_a_resident_step_attends_and_everything_for_recall():
    caps = {}
    for scope in ("resident", "topk"):
        (cfg,) = job_configs([*STUDY, "task=study/opticks", f"scope={scope}", "policy=sink_window",
                              "budget.fraction=0.2"])
        p = plan(cfg)
        caps[scope] = p.capacities["device"]
    budget = TokenBudget(int(0.2 * 2304), 4, 64, 16)
    assert caps["resident"] == max(budget.step_pages, 1 + 2 + 128 // 16)
    per_token = 30 * (3 * 16 * 2 + 4 / 16)  # recall's key sketch (rank 16 of 64 dims, bf16) and counts, every layer
    sketch = math.ceil(2304 * per_token / (30 * p.layout.page_bytes))  # in pages' worth
    assert 0 < sketch < 2304 // 16 // 4 and caps["topk"] == 2304 // 16 - sketch  # everything, less the sketch


def test_study_runs_attend_exactly_the_budget(tmp_path):
    tiny = ["task=study/passkey_after", "task.context_tokens=256", "task.depths=[0.5]", "task.max_new_tokens=4",
            "cache.window=32", "budget.fraction=0.4", "scheduler.prefill.chunk_size=64"]
    for scope, policy in (("topk", "sink_window"), ("resident", "snapkv")):
        with initialize_config_dir(str(RECIPES), version_base="1.3"):
            cfg = compose("config", overrides=[*STUDY, *tiny, f"scope={scope}", f"policy={policy}"])
        m = execute(cfg, tmp_path / scope)
        assert m["attended_tokens_per_step"] == m["attended_tokens_per_step_max"] == m["budget_tokens"] < 256
        assert m["config"]["cache"]["attend_budget"] and m["decode_steps"] > 0
