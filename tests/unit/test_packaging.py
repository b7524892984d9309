"""What the package asks of torch lets a container keep its base image's CUDA build."""

import tomllib

from packaging.requirements import Requirement


def torch_requirement(repo) -> Requirement:
    project = tomllib.loads((repo / "pyproject.toml").read_text())["project"]
    (req,) = [Requirement(d) for d in project["dependencies"] if Requirement(d).name == "torch"]
    return req


def test_ngc_torch_builds_satisfy_the_requirement(repo):
    """NGC's PyTorch images carry pre-release-numbered builds (25.01: 2.6.0a0+ecf3bae40a.nv25.01,
    25.04: 2.7.0a0+79aa17489c.nv25.04); pip must accept them as installed, not replace them."""
    spec = torch_requirement(repo).specifier
    for version in ("2.6.0a0+ecf3bae40a.nv25.01", "2.7.0a0+79aa17489c.nv25.04", "2.13.0", "2.6.0"):
        assert spec.contains(version), version
    for version in ("2.5.1", "2.5.0a0+e000cf0ad9.nv24.10"):  # no torch.nn.utils.get_total_norm
        assert not spec.contains(version), version
