"""The web console under /console: sessions.py (a credential exchanged for a signed session cookie,
with CSRF) and static/ (the page, its script and the pinned chart library: nothing is loaded from
elsewhere). Its routes are a router among the others: routes/console.py."""
