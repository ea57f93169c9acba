"""Malformed and unknown URL schemes are usage errors, never a local folder named "s3:"."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import ckptlib
from ckptlib.backends import check_url
from ckptlib.cli.main import main as cli_main


@pytest.mark.parametrize(
    ("url", "hint"),
    [("s3:/bucket/run1", "did you mean s3://bucket/run1?"), ("s3:bucket", "did you mean s3://bucket?"),
     ("memory:/x", "did you mean memory://x?"), ("s4://bucket/x", "did you mean s3://bucket/x?"),
     ("file:/data/run1", "did you mean file:///data/run1?"), ("file:run1", "did you mean file://run1?")],
)
def test_malformed_or_unknown_scheme_is_refused_with_a_hint(
    url: str, hint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=hint.replace("?", r"\?")):
        check_url(url)
    with pytest.raises(ValueError, match="did you mean"):
        ckptlib.CheckpointManager(url)
    with pytest.raises(ValueError, match="did you mean"):
        ckptlib.save({"w": torch.ones(2)}, url)
    with pytest.raises(ValueError, match="did you mean"):
        ckptlib.load(url)
    assert os.listdir(tmp_path) == []  # nothing was written anywhere


def test_cli_reports_a_malformed_url_as_a_usage_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert cli_main(["ls", "s3:/bucket/run1"]) == 2
    assert "did you mean s3://bucket/run1?" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


def test_plain_paths_with_colons_stay_local(tmp_path: Path) -> None:
    url = tmp_path / "run:1"
    ckptlib.save({"w": torch.ones(2)}, url)
    assert torch.equal(ckptlib.load(url)["w"], torch.ones(2))


def test_a_far_scheme_gets_no_hint_and_an_empty_path_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                ) -> None:
    """A hint is only a small edit away ("foo" used to be offered "root://"), and an empty path
    is refused rather than read as the current folder."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"unknown URL scheme 'foo' in 'foo://x'$"):
        check_url("foo://x")
    with pytest.raises(ValueError, match=r"did you mean memory://x\?"):
        check_url("memroy://x")
    ckptlib.save({"w": torch.ones(2)}, tmp_path / "ck")
    for call in (lambda: ckptlib.open(""), lambda: ckptlib.load(""), lambda: ckptlib.CheckpointManager(""),
                 lambda: ckptlib.save({"w": torch.ones(2)}, "")):
        with pytest.raises(ValueError, match="empty path or URL"):
            call()
    assert os.listdir(tmp_path) == ["ck"]  # nothing was written anywhere


def test_tilde_is_the_home_folder_never_a_folder_named_tilde(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``~/ckpt`` (as fsspec reads it) is under $HOME: a folder named ``~`` in the working
    directory is one ``rm -rf ~`` away from deleting the user's home."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    w = torch.arange(6, dtype=torch.float32)
    ckptlib.save({"w": w}, "~/one")
    with ckptlib.CheckpointManager("~/run", async_save=False) as mgr:
        mgr.save(3, {"w": w}).wait()
    with ckptlib.CheckpointManager("file://~/run") as mgr:
        assert mgr.latest_step() == 3
    with ckptlib.CheckpointManager("~/tiered", local="~/loc/n{node}", replicas=0, async_save=False) as mgr:
        mgr.save(4, {"w": w}).wait()
    assert cli_main(["ls", "~/tiered", "--local", "~/loc/n{node}"]) == 0
    assert os.listdir(work) == []
    assert sorted(os.listdir(home)) == ["loc", "one", "run", "tiered"]
    assert os.listdir(home / "loc") == ["n0"]
    assert torch.equal(ckptlib.load(str(home / "one"))["w"], w)
    assert torch.equal(ckptlib.load("~/run/step-000000000003")["w"], w)
    with ckptlib.open("~/run") as ckpt:
        assert ckpt.step == 3 and torch.equal(ckpt.read("/w"), w)


def _spellings(tmp_path: Path) -> list[str]:
    """Every way a user may name the run root ``tmp_path/home/runs/r1`` (HOME is ``tmp_path/home``,
    the current folder ``tmp_path``, ``tmp_path/link`` a symlink to ``tmp_path/home/runs``)."""
    real = str(tmp_path / "home" / "runs" / "r1")
    return [real, real + "/", real + "//", "home/runs/r1", "./home/runs/r1/", f"file://{real}",
            f"file://{real}/", str(tmp_path / "link" / "r1"), str(tmp_path / "link" / "r1") + "/",
            "~/runs/r1", "~/runs/r1/", "~/runs/../runs/r1"]


def test_every_spelling_of_a_root_finds_the_same_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    """Before: ``~`` was not expanded: CheckpointManager('~/runs/r1') saved into a folder
    literally named '~' under the current folder, and a relaunch from elsewhere found no
    checkpoint (restore returned None). Now ``~`` is the home folder, as in fsspec and the shell."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "home" / "runs").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "home" / "runs")
    w = torch.randn(64, 33)
    with ckptlib.CheckpointManager("~/runs/r1", async_save=False) as m:
        m.save(7, {"w": w})
    assert not (tmp_path / "~").exists()
    assert (tmp_path / "home" / "runs" / "r1" / "step-000000000007" / "manifest.json").is_file()
    for url in _spellings(tmp_path):
        into = {"w": torch.zeros(64, 33)}
        with ckptlib.CheckpointManager(url) as m:
            assert m.restore(into) == 7, url
        assert torch.equal(into["w"].view(torch.uint8), w.view(torch.uint8)), url
        got = ckptlib.load(url.rstrip("/") + "/step-000000000007")
        assert torch.equal(got["w"].view(torch.uint8), w.view(torch.uint8)), url
        with ckptlib.open(url) as ck:
            assert ck.step == 7 and torch.equal(ck.read("/w").view(torch.uint8), w.view(torch.uint8)), url
        assert cli_main(["verify", url]) == 0, url


def test_a_symlink_to_a_checkpoint_folder_stands_for_the_folder(tmp_path: Path) -> None:
    """Before: ckptlib.load('latest'), with latest -> a checkpoint folder, raised
    CorruptCheckpointError ('is a symlink ... refused') while ckptlib.open and verify read it; and
    ckptlib.save through a link to an empty folder replaced the link with the checkpoint and left
    the folder empty. Now a link naming a checkpoint folder is that folder, for all of them."""
    w = torch.randn(50, 40)
    ckptlib.save({"w": w}, tmp_path / "real")
    (tmp_path / "latest").symlink_to(tmp_path / "real")
    got = ckptlib.load(tmp_path / "latest")
    assert torch.equal(got["w"].view(torch.uint8), w.view(torch.uint8))
    with ckptlib.open(tmp_path / "latest") as ck:
        assert torch.equal(ck.read("/w").view(torch.uint8), w.view(torch.uint8))
    assert cli_main(["verify", str(tmp_path / "latest")]) == 0
    (tmp_path / "big").mkdir()
    (tmp_path / "out").symlink_to(tmp_path / "big")
    ckptlib.save({"w": w}, tmp_path / "out")
    assert (tmp_path / "out").is_symlink() and (tmp_path / "big" / "manifest.json").is_file()
    got = ckptlib.load(tmp_path / "big")
    assert torch.equal(got["w"].view(torch.uint8), w.view(torch.uint8))
