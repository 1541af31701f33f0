#!/bin/bash
# PBS Pro / OpenPBS job: DDP training with mpirun over the nodes PBS allocated.
#
# What to edit: the #PBS lines (select = nodes, mpiprocs = ranks per node, ncpus), PYTHON,
# MPIRUN. What it runs: `mpirun -n <total ranks> python examples/train.py` in the submit dir.
# (Not exercised by the test suite: there is no PBS server here. The Slurm scripts are.)
#   qsub jobs/pbs.sh
#PBS -N hpcsync-train
#PBS -l select=1:ncpus=4:mpiprocs=4
#PBS -l walltime=00:30:00
#PBS -j oe
set -euo pipefail
cd "${PBS_O_WORKDIR:-.}"
PYTHON=${PYTHON:-python3}
MPIRUN=${MPIRUN:-mpirun}
NP=$(wc -l < "${PBS_NODEFILE}")
export OMP_NUM_THREADS=${NCPUS:-1}
# Open MPI's mpirun notices a node that dropped off the network in ~11 s instead of ~8 min.
export OMPI_MCA_oob_tcp_keepalive_time=${OMPI_MCA_oob_tcp_keepalive_time:-5}
export OMPI_MCA_oob_tcp_keepalive_intvl=${OMPI_MCA_oob_tcp_keepalive_intvl:-2}
export OMPI_MCA_oob_tcp_keepalive_probes=${OMPI_MCA_oob_tcp_keepalive_probes:-3}
"$MPIRUN" -n "$NP" --hostfile "$PBS_NODEFILE" "$PYTHON" examples/train.py --out "runs/pbs-${PBS_JOBID:-local}" ${TRAIN_ARGS:-}
