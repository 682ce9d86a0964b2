"""The web console under /console: sessions.py (a credential exchanged for a signed session cookie,
with CSRF), routes.py (the page, sign-in and sign-out, the operators' deployments and health views),
static/ (the page, its script and the pinned chart library: nothing is loaded from elsewhere)."""
