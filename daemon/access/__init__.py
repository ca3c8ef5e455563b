"""Who may do what, and the file operations root does on a user's behalf: the callers' rights to a tree or a
snapshot (``callers``), a non-root snapshot's files against its owner's rights (``file_rights``, through
``asowner``, a helper that *is* the owner), path walks that never follow a symlink (``nofollow``), files in
directories callers name (``safefs``) and the daemon's own runtime directories (``rundirs``).

Nothing here may import more than ``api`` and the drivers: ``asowner`` runs as its own process
(``python -m gpusnap.daemon.access.asowner``), which imports this package first.
"""
