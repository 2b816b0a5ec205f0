"""The web dashboard at /ui (docs/ui.md): ``pages`` serves the Jinja2 page shells and the
vendored assets (open, ahead of auth), ``data_routes`` the dashboard's JSON behind auth
(``cluster_view`` the cluster snapshot, ``metrics_history`` the plots), ``modes`` the
``--ui`` setting. Keys and values are read and written by the pages' scripts through the
public API with the user's token, so ACLs and the 307 to the leader apply as for curl."""
