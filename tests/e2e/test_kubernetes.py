"""tm-launch on Kubernetes: the manifests of ``examples/kubernetes/`` and what a pod restart does.

The manifests are checked offline against Kubernetes' own schemas (``kubernetes-validate``, the
``test`` extra; skipped with one line without it), the PyTorchJob's pod template too (the
operator's custom resource has no schema there), and every manifest's ``tm-launch`` command is
parsed by tm-launch's own parser (with the ``PET_*`` variables Kubeflow injects). A pod restart
with real agents: the container of an active pod dies (its agent SIGKILLed, its worker with it),
the spare takes its rank live, and the same command started again (a new agent: a new
HOSTNAME-PID node id) joins the running job as a spare: no generation, no worker restarted; the
final state equals plain torchrun's fault-free run bit for bit.
"""

import copy
import glob
import os

import pytest
import yaml
from test_exactness import ORDINARY, differences, load
from torchrun_reference import run_torchrun

from tm_launch.launcher.options import parse_args
from tm_launch.local.localjob import REPO

K8S = os.path.join(REPO, "examples", "kubernetes")
VERSION = "1.33"  # a Kubernetes release clusters run today; the schemas ship with the package


def manifests() -> dict[str, list[dict]]:
    return {os.path.basename(p): list(yaml.safe_load_all(open(p))) for p in sorted(glob.glob(os.path.join(K8S, "*.yaml")))}


@pytest.fixture(scope="module")
def validate():
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed: pip install -e '.[test]'")

    def check(doc: dict) -> None:
        kv.validate(doc, VERSION, strict=True)  # raises on a schema violation or an unknown field

    check.error = kv.ValidationError
    return check


def pod_templates(doc: dict) -> list[dict]:
    if doc["kind"] == "PyTorchJob":
        return [spec["template"] for spec in doc["spec"]["pytorchReplicaSpecs"].values()]
    if doc["kind"] in ("Job", "StatefulSet"):
        return [doc["spec"]["template"]]
    return []


def test_the_examples_are_the_ones_documented():
    assert sorted(manifests()) == ["etcd.yaml", "pytorchjob.yaml", "train.yaml"]
    kinds = {name: [d["kind"] for d in docs] for name, docs in manifests().items()}
    assert kinds == {"etcd.yaml": ["Service", "StatefulSet"], "pytorchjob.yaml": ["PyTorchJob"], "train.yaml": ["Service", "Job"]}


def test_the_manifests_validate_against_the_kubernetes_schemas(validate):
    for name, docs in manifests().items():
        for doc in docs:
            if doc["kind"] == "PyTorchJob":  # a custom resource: its pod template is core Kubernetes
                for template in pod_templates(doc):
                    validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "worker"}, "template": template})
            else:
                validate(doc)


def test_the_validator_refuses_a_broken_manifest(validate):
    """The check above can fail: a misspelt field and a wrong type are both refused."""
    job = next(d for d in manifests()["train.yaml"] if d["kind"] == "Job")
    for break_it in (
        lambda d: d["spec"].__setitem__("completionsMode", "Indexed"),
        lambda d: d["spec"].__setitem__("parallelism", "three"),
        lambda d: d["spec"]["template"]["spec"]["containers"][0].__setitem__("comand", ["x"]),
    ):
        broken = copy.deepcopy(job)
        break_it(broken)
        with pytest.raises(validate.error):
            validate(broken)


def test_the_etcd_is_three_members_with_volumes():
    etcd = next(d for d in manifests()["etcd.yaml"] if d["kind"] == "StatefulSet")
    assert etcd["spec"]["replicas"] == 3 and etcd["spec"]["volumeClaimTemplates"]
    args = etcd["spec"]["template"]["spec"]["containers"][0]["args"]
    cluster = next(a for a in args if a.startswith("--initial-cluster="))
    assert cluster.count("=http://") == 3


def command(doc: dict) -> list[str]:
    return pod_templates(doc)[0]["spec"]["containers"][0]["command"]


@pytest.fixture
def in_a_pod(tmp_path, monkeypatch):
    """A working directory with train.py and no Slurm / PET_* variables of the test's own."""
    for k in list(os.environ):
        if k.startswith(("SLURM", "PET_")):
            monkeypatch.delenv(k)
    (tmp_path / "train.py").write_text("")
    monkeypatch.chdir(tmp_path)
    return monkeypatch


def test_the_training_pods_command_is_a_valid_tm_launch_command(in_a_pod):
    job = next(d for d in manifests()["train.yaml"] if d["kind"] == "Job")
    cmd = [a.replace("$(JOB_UID)", "0f8e4c2a-1d3b-4e5f-9a7b-6c5d4e3f2a1b") for a in command(job)]
    assert cmd[0] == "tm-launch"
    args = parse_args(cmd[1:])
    assert (args.nnodes, args.rdzv_backend, args.training_script) == ("2", "etcd-v3", "train.py")
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == 3  # 2 active + 1 spare


def test_the_pytorchjob_command_takes_kubeflows_variables(in_a_pod):
    """What Kubeflow's operator injects from elasticPolicy; the command's --nnodes wins over PET_NNODES."""
    doc = manifests()["pytorchjob.yaml"][0]
    policy = doc["spec"]["elasticPolicy"]
    assert policy["rdzvBackend"] in ("c10d", "etcd", "etcd-v2")  # the operator's choices
    in_a_pod.setenv("PET_RDZV_BACKEND", policy["rdzvBackend"])
    in_a_pod.setenv("PET_RDZV_ENDPOINT", f"{policy['rdzvHost']}:{policy['rdzvPort']}")
    in_a_pod.setenv("PET_NNODES", f"{policy['minReplicas']}:{policy['maxReplicas']}")
    args = parse_args([a.replace("$(JOB_NAME)", doc["metadata"]["name"]) for a in command(doc)[1:]])
    assert (args.nnodes, args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id) == ("2", "etcd-v2", "tm-etcd:2379", "tm-train")
    assert doc["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 3  # 2 active + 1 spare


STEPS = 24
PAUSE = 8
CASE = ("--bn", "--dropout", "0.3", "--counter", "--log-loss")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_restarted_pod_rejoins_as_a_spare_and_nothing_restarts(local_job, tmp_path):
    ref_dir = str(tmp_path / "ref")
    run_torchrun(ORDINARY, ["--steps", str(STEPS), "--out", ref_dir, *CASE], nproc=2)
    # Every rank holds at PAUSE (the test's own hold, in the script's code) from before the loss
    # until the restarted agent has parked: the promoted spare waits that long for the survivor's
    # state, longer than the default 120 s collective timeout on a loaded machine.
    launcher = ["--max-restarts", "3", "--collective-timeout", "600"]
    job = local_job(nnodes="2", nproc=1, script=ORDINARY, launcher_args=launcher)
    job.env = {"OMP_NUM_THREADS": "1"}
    out, trigger = os.path.join(job.workdir, "out"), os.path.join(job.workdir, "go")
    job.script_args = ["--steps", str(STEPS), "--out", out, *CASE, "--pause-step", str(PAUSE), "--pause-file", trigger]
    job.start_all(["a", "b"])
    job.wait_for(lambda s: s["generation"] is not None, 120, "generation 0")
    job.start("c")
    job.wait_parked("c", timeout=300)
    survivor_pids = job.worker_pids("a")
    job.kill_agent("b")  # the pod's container dies: its agent, and its worker by PDEATHSIG
    job.wait_for(
        lambda s: s["generation"] == 1 and "c" in [n["id"] for n in s["nodes"] if n["role"] == "active"], 120, "c to take b's rank"
    )
    job.start("b-again")  # the same command, restarted by the kubelet: a new agent, a new node id
    job.wait_parked("b-again", timeout=300)
    assert job.status()["generation"] == 1, "a joining spare must not start a generation"
    assert job.worker_pids("a") == survivor_pids, "the survivor's worker must keep its process"
    open(trigger, "w").close()
    codes = job.wait(timeout=300)
    assert codes["a"] == codes["c"] == codes["b-again"] == 0, job.logs_tail()
    plans = [e for e in job.events() if e["kind"] == "plan" and e.get("generation", 0) >= 1]
    assert [p["generation"] for p in plans] == [1] and plans[0]["live"], job.logs_tail()
    got, ref = load(out), load(ref_dir)
    assert sorted(got) == sorted(ref) == ["rank0", "rank1"], job.logs_tail()
    assert differences(got, ref) == {}, job.logs_tail()
