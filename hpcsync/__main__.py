"""``python -m hpcsync ...`` is the ``hpcsync`` command (``mpirun -n 4 python -m hpcsync doctor``)."""
import sys

from .cli import main

sys.exit(main())
