"""Drives the real stripe-python SDK through Idem, unmodified but for its base URL.

Usage: stripe_scenarios.py BASE_URL SCENARIO. Prints one JSON object: what the SDK returned
to its caller in that scenario (customer ids, or the error class and message it raised).
"""

import json
import sys
import threading

import stripe


def client(base, timeout=5, retries=5):
    stripe.api_key = "sk_test_idem"
    stripe.api_base = base
    stripe.max_network_retries = retries
    stripe.default_http_client = stripe.RequestsClient(timeout=timeout)


def create(key, name="Jenny Rosen"):
    try:
        customer = stripe.Customer.create(name=name, idempotency_key=key)
        return {"id": customer.id, "name": customer.name}
    except stripe.StripeError as e:
        return {
            "error": type(e).__name__,
            "code": e.code or (e.error.code if e.error else None),
            "message": e.user_message or str(e),
            "status": e.http_status,
        }


def lost_response(base):
    # The SDK gives up on its first try after 1 s; the upstream answers after 1.5 s.
    client(base, timeout=1)
    return create("lost-1")


def unavailable_then_ok(base):
    client(base)
    return create("busy-1")


def concurrent_duplicates(base):
    client(base)
    results = [None] * 20

    def one(i):
        results[i] = create("dup-1")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"results": results}


def key_reused(base):
    client(base)
    first = create("reused-1", name="Jenny Rosen")
    second = create("reused-1", name="Someone Else")
    return {"first": first, "second": second}


SCENARIOS = {
    "lost_response": lost_response,
    "unavailable_then_ok": unavailable_then_ok,
    "concurrent_duplicates": concurrent_duplicates,
    "key_reused": key_reused,
}

if __name__ == "__main__":
    base, scenario = sys.argv[1], sys.argv[2]
    print(json.dumps(SCENARIOS[scenario](base)))
