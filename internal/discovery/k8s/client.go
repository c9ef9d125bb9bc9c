package k8s

import (
	"errors"
	"fmt"
	"os"

	"k8s.io/client-go/kubernetes"
	corev1client "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
)

// NewClientset builds the API client the router runs with: the kubeconfig
// named by $KUBECONFIG when set, else the in-cluster service account, else
// the default kubeconfig (~/.kube/config). userAgent identifies the router
// in the API server's logs ("" keeps client-go's default).
//
// Only CoreV1 is usable on the result: building the full clientset
// (kubernetes.NewForConfig) would link every API group into the binary.
func NewClientset(userAgent string) (kubernetes.Interface, error) {
	cfg, err := restConfig()
	if err != nil {
		return nil, err
	}
	if userAgent != "" {
		cfg.UserAgent = userAgent
	}
	core, err := corev1client.NewForConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("kubernetes client: %w", err)
	}
	return coreOnly{core: core}, nil
}

// coreOnly is a kubernetes.Interface that implements CoreV1 alone; every
// other group's method panics (nil embedded interface). Discovery calls
// CoreV1 only.
type coreOnly struct {
	kubernetes.Interface
	core corev1client.CoreV1Interface
}

func (c coreOnly) CoreV1() corev1client.CoreV1Interface { return c.core }

func restConfig() (*rest.Config, error) {
	rules := clientcmd.NewDefaultClientConfigLoadingRules()
	fromFile := func() (*rest.Config, error) {
		return clientcmd.NewNonInteractiveDeferredLoadingClientConfig(rules, &clientcmd.ConfigOverrides{}).ClientConfig()
	}
	if os.Getenv(clientcmd.RecommendedConfigPathEnvVar) != "" {
		cfg, err := fromFile()
		if err != nil {
			return nil, fmt.Errorf("kubernetes client config from $%s: %w", clientcmd.RecommendedConfigPathEnvVar, err)
		}
		return cfg, nil
	}
	cfg, inErr := rest.InClusterConfig()
	if inErr == nil {
		return cfg, nil
	}
	cfg, err := fromFile()
	if err != nil {
		if errors.Is(inErr, rest.ErrNotInCluster) {
			return nil, fmt.Errorf("kubernetes client config: not running in a cluster and no usable kubeconfig (%s): %w",
				clientcmd.RecommendedHomeFile, err)
		}
		return nil, fmt.Errorf("kubernetes client config: in-cluster: %v; kubeconfig: %w", inErr, err)
	}
	return cfg, nil
}
