"""capture/routes.Route: each route's properties, and a route shown and saved as its plain name."""

from __future__ import annotations

import json
import pickle

from fxprep.capture.routes import Route


def test_each_route_says_what_it_is() -> None:
    table = {route.value: (route.dynamo, route.leaves, route.values, route.whole, route.rules.value) for route in Route}
    assert table == {
        "dynamo": (True, False, False, True, "dynamo"),
        "dynamo+leaves": (True, True, False, False, "dynamo"),
        "dynamo+values": (True, False, True, False, "dynamo"),
        "fx": (False, False, False, True, "fx"),
        "fx+leaves": (False, True, False, False, "fx"),
        "hf_fx": (False, False, False, True, "fx"),
    }


def test_a_route_reads_as_its_name_everywhere_a_name_went() -> None:
    route = Route.DYNAMO_LEAVES
    assert route == "dynamo+leaves" and Route("dynamo+leaves") is route  # a name read back is the member
    assert str(route) == f"{route}" == f"{route:>13}" == "dynamo+leaves"
    assert json.dumps({"tracer": route}) == '{"tracer": "dynamo+leaves"}'
    assert pickle.loads(pickle.dumps(route)) is route and {"dynamo+leaves": 1}[route] == 1
