"""One service for many teams: projects, their hashed API keys, limits and priority classes,
usage and the audit log, in one SQLite store under the data folder (``store``); the limits,
counted in that store for every server process over it (``limits``, ``windows``); the usage
table's retention (``retention``); the metering of a project's engine requests (``meter``) and
its Prometheus counters (``metrics``). Pure Python over ``sqlite3``; the server's tenancy
guard and ``/v1/organization`` routes use it."""
