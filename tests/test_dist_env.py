"""Launcher variables: torchrun-style, MPI/Slurm, their validation; the GPU of a rank; --gpus argv."""
import pytest

from rwkvx.dist.env import LaunchInfo, device_ordinal, launch_info, launched_by
from rwkvx.dist.launch import rank_env, strip_gpus

TORCHRUN = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "node7", "MASTER_PORT": "29500"}


def test_single_process():
    assert launch_info({}) is None
    assert launch_info({"MASTER_ADDR": "x", "MASTER_PORT": "1", "PATH": "/bin"}) is None
    assert launch_info({"RANK": "0", "WORLD_SIZE": "1"}) is None          # a world of one: plain path
    assert launch_info({"OMPI_COMM_WORLD_SIZE": "1", "OMPI_COMM_WORLD_RANK": "0"}) is None
    assert launch_info({"SLURM_PROCID": "0", "SLURM_NTASKS": "8"}) is None  # a batch script, not srun


def test_torchrun_variables():
    assert launch_info(TORCHRUN) == LaunchInfo("env", 1, 4, 1, "node7", 29500)
    no_local_world = {k: v for k, v in TORCHRUN.items() if k != "LOCAL_WORLD_SIZE"}
    assert launch_info(no_local_world).local_rank == 1
    # torchrun's agent serves its own store on MASTER_PORT: ours takes the next port, or ours
    assert launch_info({**TORCHRUN, "TORCHELASTIC_RUN_ID": "x"}).master_port == 29501
    assert launch_info({**TORCHRUN, "TORCHELASTIC_RUN_ID": "x", "RWKVX_MASTER_PORT": "4000"}).master_port == 4000


@pytest.mark.parametrize("change, message", [
    ({"WORLD_SIZE": None}, "RANK is set but WORLD_SIZE is not"),
    ({"RANK": None}, "WORLD_SIZE is set but RANK is not"),
    ({"RANK": "4"}, "RANK=4 must be < WORLD_SIZE=4"),
    ({"RANK": "-1"}, "RANK=-1 must be >= 0"),
    ({"WORLD_SIZE": "four"}, "WORLD_SIZE='four' is not an integer"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE=0 must be >= 1"),
    ({"MASTER_ADDR": None}, "MASTER_ADDR is not set"),
    ({"MASTER_PORT": ""}, "MASTER_PORT is not set"),
    ({"MASTER_PORT": "70000"}, "not a TCP port"),
    ({"LOCAL_RANK": None}, "LOCAL_RANK is not set"),
    ({"LOCAL_RANK": "2"}, "LOCAL_RANK=2 must be < LOCAL_WORLD_SIZE=2"),
])
def test_torchrun_variables_are_checked(change, message):
    env = dict(TORCHRUN)
    for k, v in change.items():
        if v is None:
            env.pop(k)
        else:
            env[k] = v
    with pytest.raises(ValueError, match=message):
        launch_info(env)


@pytest.mark.parametrize("env, info", [
    ({"OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_LOCAL_RANK": "1"},
     LaunchInfo("mpi", 5, 8, 1)),
    ({"PMI_SIZE": "2", "PMI_RANK": "1"}, LaunchInfo("mpi", 1, 2, None)),
    ({"PMIX_SIZE": "2", "PMIX_RANK": "0", "PMIX_LOCAL_RANK": "0"}, LaunchInfo("mpi", 0, 2, 0)),
    ({"SLURM_STEP_NUM_TASKS": "16", "SLURM_PROCID": "9", "SLURM_LOCALID": "1", "SLURM_NTASKS": "16"},
     LaunchInfo("mpi", 9, 16, 1)),
])
def test_mpi_and_slurm_variables(env, info):
    assert launch_info(env) == info


def test_torchrun_wins_over_slurm_and_bad_mpi_rank():
    env = {**TORCHRUN, "SLURM_STEP_NUM_TASKS": "1", "SLURM_PROCID": "0"}
    assert launch_info(env).method == "env"
    with pytest.raises(ValueError, match="OMPI_COMM_WORLD_RANK=3 must be < OMPI_COMM_WORLD_SIZE=2"):
        launch_info({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "3"})


def test_launched_by_names_the_variables():
    assert launched_by({}) is None
    assert launched_by({"RANK": "0", "WORLD_SIZE": "1"}) == "RANK, WORLD_SIZE"
    assert launched_by({"OMPI_COMM_WORLD_SIZE": "4"}) == "OMPI_COMM_WORLD_SIZE"


def test_device_ordinal():
    assert device_ordinal(3, 8) == 3
    assert device_ordinal(3, 1) == 0          # the launcher bound one GPU to this rank
    with pytest.raises(ValueError, match="LOCAL_RANK=3 needs GPU 3, but only 2 GPUs are visible"):
        device_ordinal(3, 2)
    with pytest.raises(ValueError, match="no CUDA GPU"):
        device_ordinal(0, 0)


def test_strip_gpus_and_rank_env():
    argv = ["--steps", "5", "--gpus", "4", "--gpu=2", "--gp", "3", "--grad-clip", "1", "--seed=2"]
    assert strip_gpus(argv) == ["--steps", "5", "--grad-clip", "1", "--seed=2"]
    env = rank_env({"PATH": "/bin", "RANK": "9"}, 2, 4, 1234)
    assert env == {"PATH": "/bin", "RANK": "2", "LOCAL_RANK": "2", "WORLD_SIZE": "4",
                   "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1234"}
    assert launch_info(env) == LaunchInfo("env", 2, 4, 2, "127.0.0.1", 1234)
