"""The CPU numerics policy: `import cosmos3_batch` puts MKL in strict CNR unless the user chose a mode,
summary.json says which mode ran, and --sp / batched branches warn once when it is not strict."""

from __future__ import annotations

import os
import subprocess

import cosmos3_batch
from cosmos3_batch.model import numerics
from tests.dist.jobs import JOB_PYTHON

PROBE = (
    "import os, cosmos3_batch, torch; from cosmos3_batch.model.numerics import mkl_cnr_mode; "
    "torch.ones(4, 4) @ torch.ones(4, 4); print(os.environ['MKL_CBWR'], mkl_cnr_mode())"
)


def _probe(**env: str | None) -> str:
    environ = {k: v for k, v in os.environ.items() if k not in ("MKL_CBWR", cosmos3_batch.CNR_MARK)}
    environ.update({k: v for k, v in env.items() if v is not None})
    return subprocess.run(
        [JOB_PYTHON, "-c", PROBE], env=environ, capture_output=True, text=True, check=True
    ).stdout


def test_the_project_sets_strict_cnr_when_the_user_did_not():
    assert _probe().split() == ["AUTO,STRICT", "AUTO,STRICT"]


def test_a_users_mode_wins_and_an_empty_one_means_mkls_default():
    assert _probe(MKL_CBWR="COMPATIBLE").split() == ["COMPATIBLE", "COMPATIBLE"]
    assert _probe(MKL_CBWR="").split() == ["OFF"]  # MKL_CBWR= : the opt-out, MKL's own default


def test_a_child_of_ours_reports_the_mode_as_ours_and_a_users_equal_mode_as_theirs():
    # cosmos3-torchrun imports the package, which sets MKL_CBWR; its workers inherit it and must still say
    # that the project set it (summary.json cpu_numerics.set_by).
    probe = "import cosmos3_batch; print(cosmos3_batch.CNR_SET_BY_US)"
    base = {k: v for k, v in os.environ.items() if k not in ("MKL_CBWR", cosmos3_batch.CNR_MARK)}
    launcher = subprocess.run(
        [
            JOB_PYTHON,
            "-c",
            "import os, subprocess, sys, cosmos3_batch; "
            f"sys.exit(subprocess.run([sys.executable, '-c', {probe!r}]).returncode)",
        ],
        env=base,
        capture_output=True,
        text=True,
        check=True,
    )
    assert launcher.stdout.strip() == "True"
    user = subprocess.run(
        [JOB_PYTHON, "-c", probe], env={**base, "MKL_CBWR": "AUTO,STRICT"}, capture_output=True, text=True
    )
    assert user.stdout.strip() == "False"


def test_this_test_process_runs_under_the_policy():
    # The exactness tests of this suite compare against the reference in this same process, under this mode.
    expected = cosmos3_batch.STRICT_CNR if cosmos3_batch.CNR_SET_BY_US else None
    if expected is not None:
        assert numerics.mkl_cnr_mode() == expected
    record = numerics.cpu_numerics()
    assert record["mkl_cbwr"] == numerics.mkl_cnr_mode()
    assert record["set_by"] == ("cosmos3_batch" if cosmos3_batch.CNR_SET_BY_US else "user")


def test_no_warning_under_strict_mode(caplog, monkeypatch):
    monkeypatch.setattr(numerics, "mkl_cnr_mode", lambda: "AUTO,STRICT")
    assert numerics.warn_unless_strict("--sp 2") is False
    assert not caplog.records


def test_one_warning_names_what_and_the_mode(caplog, monkeypatch):
    monkeypatch.setattr(numerics, "mkl_cnr_mode", lambda: "OFF")
    monkeypatch.setenv("MKL_CBWR", "")
    assert numerics.warn_unless_strict("--sp 2") is True
    (record,) = caplog.records
    assert "--sp 2 on CPU" in record.getMessage() and "CNR OFF" in record.getMessage()
    assert "last bits" in record.getMessage()
