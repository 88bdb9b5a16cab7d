"""`python -m dspark …`: the `dspark` command, for a process that knows its interpreter but not the script
(`dspark bench --sweep` starts its servers this way)."""

from dspark.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
