"""``python -m hpcsync ...`` is the ``hpcsync`` command (``mpirun -n 4 python -m hpcsync doctor``)."""
import sys

from .cli import main

__all__ = []

sys.exit(main())
