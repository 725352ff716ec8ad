"""``quickdraft tune layer-skip``: an Optuna study in SQLite that resumes, a skip profile
that ``generate --method layer-skip`` loads, and the study's plots."""

import json

import optuna
import pytest

from quickdraft.cli import main
from quickdraft.drafters.layer_skip import SkipProfile
from quickdraft.tune.layer_skip import first_guesses, profile_from_params


def test_first_guesses_skip_every_other_inner_layer():
    guesses = first_guesses(8)
    mlp_only = profile_from_params(guesses[0], 8, "m", "")
    assert mlp_only.skip_mlp == [1, 3, 5] and mlp_only.skip_attn == []
    both = profile_from_params(guesses[2], 8, "m", "")
    assert both.skip_attn == both.skip_mlp == [1, 3, 5]


@pytest.mark.slow
def test_tune_writes_a_profile_resumes_and_plots(tiny_family, tmp_path, capsys):
    model = str(tiny_family["target"])
    out = tmp_path / "profile.json"
    args = ["tune", "layer-skip", "--model", model, "--tokens", "6", "--max-k", "3", "--out", str(out),
            "--measure-best", "1"]
    assert main([*args, "--trials", "3"]) == 0
    profile = SkipProfile.load(out)
    assert profile.n_layers == 2 and 1 <= profile.k <= 3 and profile.predicted_speedup > 0
    assert profile.info["trials"] == 3 and profile.info["measured_best"][0]["speedup"] > 0
    assert (tmp_path / "profile-history.png").stat().st_size > 1000
    # The study is in SQLite next to the profile; running again with more trials resumes it.
    assert main([*args, "--trials", "5"]) == 0
    study = optuna.load_study(study_name=json.loads(out.read_text())["info"]["study_name"],
                              storage=f"sqlite:///{tmp_path / 'profile.db'}")
    assert len(study.trials) == 5
    # The warm starts ran first (every other inner layer: none in a 2-layer model).
    assert study.trials[0].params == first_guesses(2)[0]
    capsys.readouterr()
    assert main(["generate", "--model", model, "--method", "layer-skip", "--skip-profile", str(out),
                 "--prompt", "def f(x):", "--max-new-tokens", "8", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["settings"]["num_speculative_tokens"] == SkipProfile.load(out).k
