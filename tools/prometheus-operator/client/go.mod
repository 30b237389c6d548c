// The Prometheus Operator's generated client (clientset, listers, informers, apply configurations).
// Its module, github.com/prometheus-operator/prometheus-operator/pkg/client, is not served by the Go
// module proxy at v0.94.0; build.sh generates it here from the served API types
// (pkg/apis/monitoring v0.94.0) with k8s.io/code-generator, as upstream's `make k8s-client-gen` does.
module github.com/prometheus-operator/prometheus-operator/pkg/client

go 1.26.0

require (
	github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring v0.94.0
	k8s.io/api v0.37.2
	k8s.io/apimachinery v0.37.2
	k8s.io/client-go v0.37.2
)
