"""`kvrelay deploy` (stand up a topology) and `kvrelay validate` (the tutorial's checks).

Light on purpose: nothing here imports torch at module import; the servers do that.

    shapes.py    the model facts a layout depends on (config.json, or the built-in gpt-oss ids)
    topology.py  what the user asked for (flags or YAML) as frozen dataclasses, and its checks
    plan.py      every process's host, ports, device slice, environment and exact command
    launcher.py  start the planned processes, await readiness, stop them all (by process group)
    validate.py  the "Confirm your work" checks against a running server or proxy
    main.py      the `kvrelay deploy` command
"""
