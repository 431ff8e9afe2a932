"""One lesson file, every launcher: the command line (cli.py), who started us (environment.py), each rank's
device and backend (devices.py), where rank 0 listens (ports.py), the ranks of --nproc N started, watched and
ended (supervise.py, gc_paused.py), and launch() that ties them together (launch.py); what a lesson needs from
the Python environment, checked before torch is imported (requires.py)."""
